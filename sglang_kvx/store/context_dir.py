"""The context directory's files, read and written: run on the disk tier's worker thread only.

The server touches only names of its own (``context_file.is_own_name``) and, among those, only files
it can prove are its own: a manifest parsed as this format for this model, a tensor file whose name
carries that manifest's key, a temporary or unnamed tensor file of its own name pattern whose header
is a safetensors header of ours. A file it cannot parse is counted, logged once and left alone; a
refused manifest of its own is removed, and its tensor file with it only when that name carries the
manifest's key. Each file of a scan is handled alone: any fault refuses that file, never the scan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sglang_kvx.store.context_file import (MANIFEST_NAME, MARKER, MARKER_TEXT, MAX_MANIFEST_BYTES, TEMP_NAME,
                                           TENSORS_NAME, DiskEntry, RefusedFile, context_key, decode, encode,
                                           owns_manifest, parse_manifest, read_regular, sign, tensor_file,
                                           tensors_name_of, tensors_of, write_atomic, write_tensor_file)
from sglang_kvx.store.fit_check import PoolFacts, misfit
from sglang_kvx.store.tiers import TieredContext

logger = logging.getLogger(__name__)

STALE_S = 300.0  # a temporary or unnamed tensor file of ours this old is a dead writer's: removed
RESCAN_S = 1.0  # the directory is listed again at least this often when its mtime seems unchanged


class ContextDirectory:
    """This model's context files in one directory, at most ``capacity`` bytes (least recently used out)."""

    def __init__(self, directory: Path, capacity: int, fingerprint: str, facts: PoolFacts | None,
                 secret: bytes | None) -> None:
        self.directory = directory
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.facts = facts  # None: contexts are read back without checking them against a pool (tools)
        self.secret = secret
        self.entries: dict[str, DiskEntry] = {}  # key -> this model's files, as of the last scan
        self.dropped = 0  # files removed for room (or too large to write)
        self.written = 0
        self.write_failures = 0
        self.refused: Counter[str] = Counter()  # files refused, by reason
        self.last_refusal: str | None = None
        self._left_alone: dict[str, int] = {}  # manifests refused but not provably ours -> their mtime_ns
        self._warned: set[str] = set()
        self._scanned = (0, 0.0)  # the directory's mtime and when it was last listed

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def claim(self) -> None:
        """Make the directory (if missing) and mark it as a context directory of this format."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not (self.directory / MARKER).exists():
                write_atomic(self.directory, MARKER, MARKER_TEXT.encode())
        except OSError as exc:
            self.warn_once("claim", "sglang_kvx: cannot prepare --kvx-context-dir %s (%s): contexts stay in the tiers "
                           "above", self.directory, exc.strerror)

    # --- scanning --------------------------------------------------------------------------------

    def scan(self, force: bool = False) -> bool:
        """Bring the index up to date with the directory (other servers write and remove files too): at
        once when the directory changed, else at most every ``RESCAN_S``. Whether the index changed."""
        try:
            changed = os.stat(self.directory).st_mtime_ns
            if not force and changed == self._scanned[0] and time.monotonic() - self._scanned[1] < RESCAN_S:
                return False
            names = os.listdir(self.directory)
        except OSError:
            had = bool(self.entries)
            self.entries.clear()
            return had
        self._scanned = (changed, time.monotonic())
        before = dict(self.entries)
        manifests = {m.group(1) for m in map(MANIFEST_NAME.fullmatch, names) if m}
        for key in list(self.entries):
            if key not in manifests:
                del self.entries[key]
        present = set(names)
        for key in manifests:
            try:
                self._scan_one(key, present)
            except Exception as exc:  # noqa: BLE001 - one file's fault is that file's, never the scan's
                self._refuse(key, RefusedFile("unreadable_manifest", f"{key}.json: {type(exc).__name__}"), owned=False)
        self._remove_stale(names)
        return self.entries.keys() != before.keys() or any(self.entries[k] is not before[k] for k in self.entries)

    def _scan_one(self, key: str, present: set[str]) -> None:
        path = self.directory / f"{key}.json"
        try:
            info = os.lstat(path)
        except OSError:
            return
        known = self.entries.get(key)
        if (known is not None and known.mtime_ns == info.st_mtime_ns) or self._left_alone.get(key) == info.st_mtime_ns:
            return
        try:
            data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
            entry = parse_manifest(key, data, self.fingerprint, info.st_mtime, info.st_mtime_ns, self.secret)
        except RefusedFile as refused:
            if refused.reason == "other_model":  # another model's servers' file: theirs to use
                self._left_alone[key] = info.st_mtime_ns
                self.refused[refused.reason] += 1
                return
            self._refuse(key, refused, owned=_owns(path, self.fingerprint), mtime_ns=info.st_mtime_ns)
            return
        except OSError:
            return  # removed meanwhile
        if entry.tensors not in present:
            self._refuse(key, RefusedFile("missing_tensors", f"{entry.tensors} is not in the directory"), owned=True)
            return
        self.entries[key] = entry

    def _remove_stale(self, names: list[str]) -> None:
        """Temporary files of dead writers, and tensor files of ours no manifest names, once ``STALE_S`` old
        -- each only after its header shows it is one of ours."""
        named = {e.tensors for e in self.entries.values()}
        now = time.time()
        for name in names:
            temp = TEMP_NAME.fullmatch(name)
            inner = temp.group(1) if temp else name
            if temp is None and (not TENSORS_NAME.fullmatch(name) or name in named):
                continue
            if not (MANIFEST_NAME.fullmatch(inner) or TENSORS_NAME.fullmatch(inner) or inner == MARKER):
                continue
            if not stat_is_regular(self.directory / name):
                continue
            path = self.directory / name
            try:
                info = os.lstat(path)
                # A temporary of our name pattern is ours by its name (a killed writer may have left it
                # too short for a header); an unnamed tensor file only when its header is ours.
                if now - info.st_mtime <= STALE_S or (temp is None and not _is_ours(path, inner)):
                    continue
                tensor_key = TENSORS_NAME.fullmatch(inner)
                if temp is None and tensor_key and (self.directory / f"{tensor_key.group(1)}.json").exists():
                    continue  # a manifest of another model (or one left alone) may name it
                path.unlink()
            except (OSError, RefusedFile, ValueError):
                continue

    def _refuse(self, key: str, refused: RefusedFile, owned: bool, mtime_ns: int | None = None) -> None:
        """Count and log a file that must never be served; remove it only when it is provably ours."""
        self.refused[refused.reason] += 1
        self.last_refusal = str(refused)
        entry = self.entries.pop(key, None)
        if not owned:
            if mtime_ns is not None:
                self._left_alone[key] = mtime_ns
            self.warn_once(f"alone:{key}", "sglang_kvx: context file %s.json in %s cannot be read as one of this "
                           "server's (%s); left alone", key, self.directory, refused)
            return
        logger.warning("sglang_kvx: refused context file %s.json in %s (%s); removed", key, self.directory, refused)
        manifest = entry.manifest if entry is not None else _manifest_of(self.directory / f"{key}.json")
        self._unlink(f"{key}.json")
        tensors = manifest.get("tensors") if isinstance(manifest, dict) else None
        if tensors_name_of(key, tensors):
            self._unlink(tensors)

    def _unlink(self, name: str) -> None:
        try:
            path = self.directory / name
            if os.path.isfile(path) and not os.path.islink(path):
                path.unlink()
        except OSError:
            pass

    # --- reading, writing, removing -----------------------------------------------------------------

    def read(self, entry: DiskEntry) -> TieredContext:
        """The context read back and checked against the pool. Raises ``RefusedFile`` (its files are then
        removed) or ``OSError`` (a file another server removed)."""
        path = self.directory / entry.tensors
        try:
            try:
                data = read_regular(path, exact_bytes=entry.nbytes)
            except FileNotFoundError:
                self.entries.pop(entry.key, None)
                raise
            if hashlib.sha256(data).hexdigest() != entry.manifest["tensors_sha256"]:
                raise RefusedFile("checksum", f"{entry.tensors} is torn or corrupted")
            tensors = tensors_of(data, entry.tensors)
            try:
                context = decode(entry.manifest, tensors)
            except Exception as exc:  # noqa: BLE001 - whatever a bad file raises, it is refused, not served
                raise RefusedFile("bad_tensors", f"{entry.tensors}: {type(exc).__name__}") from None
            if self.facts is not None and (problem := misfit(context, self.facts)):
                raise RefusedFile("misfit", f"{entry.tensors}: {problem}")
        except RefusedFile as refused:
            self._refuse(entry.key, refused, owned=True)
            raise
        self.touch(entry)
        return context

    def touch(self, entry: DiskEntry) -> None:
        """Used now, for every server sharing the directory: least recently used goes first."""
        try:
            manifest = self.directory / f"{entry.key}.json"
            os.utime(manifest)
            info = manifest.stat()
            entry.last_used, entry.mtime_ns = info.st_mtime, info.st_mtime_ns
        except OSError:
            pass

    def write(self, context: TieredContext) -> list[DiskEntry]:
        """Write ``context`` unless its files are there; returns the entries removed for room. A context
        that can never fit is dropped (counted); a write that fails (no file form for its snapshot, an
        unwritable directory, a full disk) is counted and logged once, and the context stays in the
        tiers above as if this one were off."""
        key = context_key(self.fingerprint, context.context_ids, context.settings)
        known = self.entries.get(key)
        if known is not None and (self.directory / known.tensors).exists():
            return []
        try:
            tensors, manifest = encode(context, self.fingerprint)
            file = tensor_file(tensors)
        except ValueError as exc:
            self.write_failures += 1
            self.warn_once("encode", "sglang_kvx: a compacted context cannot be written to disk: %s", exc)
            return []
        if file.nbytes > self.capacity:
            self.dropped += 1
            return []
        let_go = self._make_room(file.nbytes, keep=key)
        try:
            name, digest = write_tensor_file(self.directory, key, file)
            manifest.update(tensors=name, tensors_bytes=file.nbytes, tensors_sha256=digest)
            if self.secret is not None:
                manifest["hmac"] = sign(manifest, self.secret)
            write_atomic(self.directory, f"{key}.json", json.dumps(manifest).encode())
            info = (self.directory / f"{key}.json").stat()
        except OSError as exc:
            self.write_failures += 1
            if "tensors" in manifest:
                self._unlink(manifest["tensors"])
            self.warn_once("write", "sglang_kvx: cannot write context files to %s (%s): contexts stay in the tiers "
                           "above (logged once)", self.directory, exc.strerror or exc)
            return let_go
        self.written += 1
        self.entries[key] = DiskEntry(key, manifest, context.context_ids, context.settings, file.nbytes, info.st_mtime,
                                      context.tenant, info.st_mtime_ns)
        return let_go

    def _make_room(self, size: int, keep: str) -> list[DiskEntry]:
        let_go = []
        while self.entries and self.nbytes + size > self.capacity:
            victim = min((e for e in self.entries.values() if e.key != keep), key=lambda e: e.last_used, default=None)
            if victim is None:
                break
            self.remove(victim)
            let_go.append(victim)
        self.dropped += len(let_go)
        return let_go

    def remove(self, entry: DiskEntry) -> None:
        self.entries.pop(entry.key, None)
        self._unlink(f"{entry.key}.json")  # the manifest first: no reader then finds a half-removed context
        if tensors_name_of(entry.key, entry.tensors):
            self._unlink(entry.tensors)

    def clear(self) -> None:
        """/flush_cache: this model's files go (another model's, and files not ours, stay)."""
        self.scan(force=True)
        for entry in list(self.entries.values()):
            self.remove(entry)


def _manifest_of(path: Path) -> Any:
    try:
        return json.loads(read_regular(path, max_bytes=MAX_MANIFEST_BYTES))
    except Exception:  # noqa: BLE001 - unreadable: no tensor file is named
        return None


def _owns(path: Path, fingerprint: str) -> bool:
    """Whether the manifest at ``path`` is provably a file of ours (this format, this model)."""
    return owns_manifest(_manifest_of(path), fingerprint)


def stat_is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_ours(path: Path, name: str) -> bool:
    """Whether a regular file of our tensor-file name pattern holds a safetensors header of ours (the
    keys and values of attention layer 0)."""
    if not TENSORS_NAME.fullmatch(name):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 8)
        if len(head) != 8:
            return False
        (size,) = struct.unpack("<Q", head)
        if not 0 < size <= 1 << 24:
            return False
        raw = b""
        while len(raw) < size:
            chunk = os.read(fd, size - len(raw))
            if not chunk:
                return False
            raw += chunk
        header = json.loads(raw)
    finally:
        os.close(fd)
    return isinstance(header, dict) and "k.0" in header and "v.0" in header
