"""The disk tier: compacted contexts as files, outliving the pool, the host tier and the process.

One context is two files in ``--kvx-context-dir``:
  ``<key>.<digest>.safetensors``  its tensors: per attention layer the kept keys and values over its S
                                   slots (``k.L`` / ``v.L``), the kept positions (``pos.L`` or ``pos.L.H``)
                                   and the recurrent-state snapshot's tensors (``gdn.I``);
  ``<key>.json``                   the manifest: the model's fingerprint, the token ids (and their hash),
                                   the settings, the layout and cells, the tenant, and the tensor file's
                                   name, size and SHA-256.
``key`` hashes (fingerprint, token ids, settings), so the same context written by two servers of the
same model is one key; ``digest`` is the tensor file's own SHA-256, so two writers never write the
same tensor file name with different bytes. Each file is written to a temporary name, fsynced and
renamed (atomic on POSIX); the manifest goes last, so a manifest names only a complete tensor file.
A kill -9 mid-write leaves a temporary file (never loaded, removed when stale) or a tensor file no
manifest names (removed when stale). A manifest that does not parse, names a missing file, or whose
tensor file fails its checksum or its shapes is refused, counted by reason, and removed; a manifest
of another model (another fingerprint) is left for its own servers and never loaded.

Several servers may share the directory (``docs/deployment.md``): each rescans it before a lookup,
so a context one server wrote is found by every other; use is marked on the manifest's mtime, which
the least-recently-used room-making of every server reads (``--kvx-disk-store-gb`` bounds the bytes of
this model's files; every server sharing the path should pass the same bound).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_kvx.compact.layout import Borrowed, LayerCells, PrefixLayout
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.store import PrefixCells, longest_extended
from sglang_kvx.store.tiers import TieredContext

logger = logging.getLogger(__name__)

FORMAT = 1  # the manifest's "format": files of another format are refused
STALE_S = 300.0  # a temporary or unnamed tensor file this old is a dead writer's: removed
RESCAN_S = 1.0  # the directory is listed again at least this often when it seems unchanged


class RefusedFile(Exception):
    """A context file that must not be served; ``reason`` is the counter's key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def model_fingerprint(model_path: str, tokenizer_path: str, facts: dict[str, Any]) -> str:
    """What a context file must match to load: the model's config, weights (names and sizes: hashing
    the bytes of a large checkpoint would take minutes), tokenizer files, and ``facts`` (the KV pool's
    dtype and layout, the attention layers, the parallelism). A hub id that is no local folder counts
    by its name."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for label, path in (("model", model_path), ("tokenizer", tokenizer_path or model_path)):
        folder = Path(path).expanduser()
        digest.update(f"{label}:{path if not folder.is_dir() else ''}".encode())
        if not folder.is_dir():
            continue
        for file in sorted(folder.iterdir()):
            if file.suffix in (".safetensors", ".bin", ".pt"):
                digest.update(f"{file.name}:{file.stat().st_size}".encode())
            elif file.suffix in (".json", ".model", ".txt", ".tiktoken") and file.is_file():
                digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()[:32]


def context_key(fingerprint: str, context_ids: tuple[int, ...], settings: CompactionSettings) -> str:
    digest = hashlib.sha256(fingerprint.encode())
    digest.update(torch.tensor(context_ids, dtype=torch.int64).numpy().tobytes())
    digest.update(json.dumps(_settings_json(settings), sort_keys=True).encode())
    return digest.hexdigest()[:40]


@dataclass
class DiskEntry:
    """A context file the directory holds: its manifest, read; the tensors stay on disk until taken."""

    key: str
    manifest: dict[str, Any]
    context_ids: tuple[int, ...]
    settings: CompactionSettings
    nbytes: int  # the tensor file's size
    last_used: float  # the manifest's mtime
    tenant: str | None = None
    mtime_ns: int = field(default=0, repr=False)

    @property
    def n(self) -> int:
        return len(self.context_ids)


class DiskTier:
    """Context files in one directory, this model's at most ``capacity`` bytes (least recently used first out)."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity: int, fingerprint: str) -> None:
        self.directory = Path(directory).expanduser()
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.entries: dict[str, DiskEntry] = {}  # key -> this model's files, as of the last scan
        self.dropped = 0  # files removed for room (or too large to write)
        self.written = 0
        self.write_failures = 0
        self.refused: Counter[str] = Counter()  # files refused, by reason
        self.last_refusal: str | None = None
        self._foreign: set[str] = set()  # manifests of another model, counted once
        self._warned: set[str] = set()
        self._scanned = (0, 0.0)  # the directory's mtime and when it was last listed
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._warn_once("mkdir", "sglang_kvx: cannot create --kvx-context-dir %s (%s): contexts stay in the tiers "
                            "above", self.directory, exc.strerror)
        self.scan(force=True)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    # --- the directory ------------------------------------------------------------------------------

    def scan(self, force: bool = False) -> None:
        """Bring the index up to date with the directory (other servers write and remove files too):
        at once when the directory changed, else at most every ``RESCAN_S`` (a file system whose
        directory times are coarse -- some network ones -- may not show a change at once)."""
        try:
            changed = os.stat(self.directory).st_mtime_ns
            if not force and changed == self._scanned[0] and time.monotonic() - self._scanned[1] < RESCAN_S:
                return
            names = os.listdir(self.directory)
        except OSError:
            self.entries.clear()
            return
        self._scanned = (changed, time.monotonic())
        present = set(names)
        manifests = {name[:-5] for name in names if name.endswith(".json") and not name.startswith(".")}
        for key in list(self.entries):
            if key not in manifests:
                del self.entries[key]
        for key in manifests:
            if key in self._foreign:
                continue
            path = self.directory / f"{key}.json"
            try:
                stat = path.stat()
            except OSError:
                continue
            known = self.entries.get(key)
            if known is not None and known.mtime_ns == stat.st_mtime_ns:
                continue
            try:
                entry = read_manifest(self.directory, key, stat, self.fingerprint)
            except RefusedFile as refused:
                if refused.reason == "other_model":
                    self._foreign.add(key)
                    self.refused[refused.reason] += 1
                    continue
                self._refuse(key, refused)
                continue
            if entry.manifest["tensors"] not in present:
                self._refuse(key, RefusedFile("missing_tensors", f"{entry.manifest['tensors']} is not in the directory"))
                continue
            self.entries[key] = entry
        self._remove_stale(names)

    def _remove_stale(self, names: list[str]) -> None:
        """Temporary files of dead writers, and tensor files no manifest names, once ``STALE_S`` old."""
        named = {e.manifest["tensors"] for e in self.entries.values()}
        now = time.time()
        for name in names:
            dead = name.startswith(".tmp-") or (name.endswith(".safetensors") and name not in named
                                                 and name.split(".")[0] not in self._foreign)
            if dead:
                path = self.directory / name
                try:
                    if now - path.stat().st_mtime > STALE_S:
                        path.unlink()
                except OSError:
                    pass

    def _refuse(self, key: str, refused: RefusedFile) -> None:
        """Count, log and remove a file that must never be served."""
        self.refused[refused.reason] += 1
        self.last_refusal = f"{key}: {refused}"
        logger.warning("sglang_kvx: refused context file %s in %s (%s); removed", key, self.directory, refused)
        entry = self.entries.pop(key, None)
        self._unlink(f"{key}.json")
        if entry is not None:
            self._unlink(entry.manifest["tensors"])

    def _unlink(self, name: str) -> None:
        try:
            (self.directory / name).unlink()
        except OSError:
            pass

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    # --- the tier ----------------------------------------------------------------------------------

    def holds(self, context_ids: tuple[int, ...], settings: CompactionSettings) -> bool:
        return context_key(self.fingerprint, context_ids, settings) in self.entries

    def put(self, entry: TieredContext) -> list[DiskEntry | TieredContext]:
        """Write ``entry`` unless its file is there already; returns the files removed for room, and
        ``entry`` itself when it is not held: it can never fit, or the write failed (full disk,
        unwritable directory: logged once, counted; the context is then as without this tier)."""
        self.scan()
        key = context_key(self.fingerprint, entry.context_ids, entry.settings)
        if key in self.entries and (self.directory / self.entries[key].manifest["tensors"]).exists():
            return []
        try:
            tensors, manifest = encode(entry, self.fingerprint)
        except ValueError as exc:
            self.write_failures += 1
            self._warn_once("encode", "sglang_kvx: a compacted context cannot be written to disk: %s", exc)
            return [entry]
        from safetensors.torch import save

        data = save(tensors)
        if len(data) > self.capacity:
            self.dropped += 1
            return [entry]
        let_go = self._make_room(len(data), keep=key)
        digest = hashlib.sha256(data).hexdigest()
        manifest.update(tensors=f"{key}.{digest[:16]}.safetensors", tensors_bytes=len(data), tensors_sha256=digest)
        try:
            write_atomic(self.directory, manifest["tensors"], data)
            write_atomic(self.directory, f"{key}.json", json.dumps(manifest).encode())
        except OSError as exc:
            self.write_failures += 1
            self._unlink(manifest["tensors"])
            self._warn_once("write", "sglang_kvx: cannot write context files to %s (%s): contexts stay in the tiers "
                            "above (logged once)", self.directory, exc.strerror or exc)
            return [*let_go, entry]
        self.written += 1
        stat = (self.directory / f"{key}.json").stat()
        self.entries[key] = DiskEntry(key, manifest, entry.context_ids, entry.settings, len(data), stat.st_mtime,
                                      entry.tenant, stat.st_mtime_ns)
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

    def longest_prefix_of(self, prompt_ids, settings: CompactionSettings) -> DiskEntry | None:
        self.scan()
        return longest_extended(self.entries.values(), prompt_ids, settings)

    def take(self, entry: DiskEntry) -> TieredContext:
        """The context read back, checked; the files stay (another server, or a restart, may read them).
        Raises ``RefusedFile`` (the files are then removed) or ``OSError`` (a file another server removed)."""
        from safetensors.torch import load

        try:
            data = (self.directory / entry.manifest["tensors"]).read_bytes()
        except FileNotFoundError:
            self.entries.pop(entry.key, None)
            raise
        try:
            if len(data) != entry.nbytes or hashlib.sha256(data).hexdigest() != entry.manifest["tensors_sha256"]:
                raise RefusedFile("checksum", f"{entry.manifest['tensors']} is torn or corrupted "
                                              f"({len(data)} bytes, {entry.nbytes} written)")
            try:
                context = decode(entry.manifest, load(data))
            except Exception as exc:  # noqa: BLE001 - whatever a bad file raises, it is refused, not served
                raise RefusedFile("bad_tensors", f"{type(exc).__name__}: {exc}") from None
        except RefusedFile as refused:
            self._refuse(entry.key, refused)
            raise
        try:
            manifest = self.directory / f"{entry.key}.json"
            os.utime(manifest)  # used now, for every server sharing the directory: least recently used goes first
            stat = manifest.stat()
            entry.last_used, entry.mtime_ns = stat.st_mtime, stat.st_mtime_ns
        except OSError:
            pass
        return context

    def remove(self, entry: DiskEntry) -> None:
        self.entries.pop(entry.key, None)
        self._unlink(f"{entry.key}.json")  # the manifest first: no reader then finds a half-removed context
        self._unlink(entry.manifest["tensors"])

    def clear(self) -> None:
        """/flush_cache: this model's files go (another model's stay)."""
        for entry in list(self.entries.values()):
            self.remove(entry)

    def summaries(self) -> list[dict[str, Any]]:
        return [{"context_tokens": e.n, "bytes": e.nbytes, "policy": e.settings.policy,
                 "keep_fraction": e.settings.keep_fraction, "tenant": e.tenant} for e in self.entries.values()]


# --- the file format -------------------------------------------------------------------------------


def write_atomic(directory: Path, name: str, data: bytes) -> None:
    """Temporary file, fsync, rename, fsync of the directory: a reader sees the whole file or none."""
    tmp = directory / f".tmp-{os.getpid()}-{time.monotonic_ns()}-{name}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / name)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path, key: str, stat: os.stat_result, fingerprint: str) -> DiskEntry:
    """The manifest ``<key>.json``, checked: its format, its model, its fields, its name."""
    try:
        manifest = json.loads((directory / f"{key}.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RefusedFile("unreadable_manifest", str(exc)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise RefusedFile("unreadable_manifest", f"not a format-{FORMAT} context manifest")
    if manifest.get("fingerprint") != fingerprint:
        raise RefusedFile("other_model", "written by a server of another model, tokenizer or KV layout")
    try:
        ids = tuple(int(t) for t in manifest["context_ids"])
        settings = CompactionSettings(**manifest["settings"])
        entry = DiskEntry(key=key, manifest=manifest, context_ids=ids, settings=settings,
                          nbytes=int(manifest["tensors_bytes"]), last_used=stat.st_mtime,
                          tenant=manifest.get("tenant"), mtime_ns=stat.st_mtime_ns)
        if not isinstance(manifest["tensors"], str) or "/" in manifest["tensors"]:
            raise ValueError("tensors must be a file name")
    except (KeyError, TypeError, ValueError) as exc:
        raise RefusedFile("unreadable_manifest", f"{type(exc).__name__}: {exc}") from None
    if context_key(fingerprint, ids, settings) != key:
        raise RefusedFile("key_mismatch", "the manifest's token ids or settings are not the ones its name hashes")
    return entry




def _settings_json(settings: CompactionSettings) -> dict[str, Any]:
    return {"policy": settings.policy, "keep_fraction": settings.keep_fraction,
            "protected_prefix_len": settings.protected_prefix_len, "allocation": settings.allocation}


def _cells_json(cells: LayerCells) -> dict[str, Any]:
    return {"own": cells.own, "borrowed": [[b.layer, b.start, b.end, b.head] for b in cells.borrowed]}


def _cells_of(raw: dict[str, Any]) -> LayerCells:
    return LayerCells(int(raw["own"]), tuple(Borrowed(int(l), int(s), int(e), None if h is None else int(h))
                                             for l, s, e, h in raw["borrowed"]))


def _prefix_cells_json(cell: PrefixCells | None) -> dict[str, Any] | None:
    """A layer's cells without their pool slots (a restore re-points them from the layout)."""
    if cell is None:
        return None
    return {"num_slots": cell.num_slots, "own": cell.own, "borrowed": [layer_id for layer_id, _ in cell.borrowed],
            "head_own": None if cell.head_own is None else list(cell.head_own),
            "head_borrowed": None if cell.head_borrowed is None else
            [[[layer_id, head] for layer_id, head, _ in ranges] for ranges in cell.head_borrowed]}


def _prefix_cells_of(raw: dict[str, Any] | None) -> PrefixCells | None:
    if raw is None:
        return None
    empty = torch.empty(0, dtype=torch.int64)
    return PrefixCells(int(raw["num_slots"]), int(raw["own"]), tuple((int(l), empty) for l in raw["borrowed"]),
                       None if raw["head_own"] is None else tuple(int(h) for h in raw["head_own"]),
                       None if raw["head_borrowed"] is None else
                       tuple(tuple((int(l), int(h), empty) for l, h in ranges) for ranges in raw["head_borrowed"]))


def _tree_out(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` (nested tuples / lists of tensors, as a GDN snapshot is) as JSON, its tensors into ``tensors``."""
    if isinstance(value, torch.Tensor):
        name = f"{prefix}.{len(tensors)}"
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": name}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [_tree_out(v, prefix, tensors) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"a {type(value).__name__} in the recurrent-state snapshot has no file form")


def _tree_in(raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in raw:
        return tensors[raw["tensor"]]
    if "tuple" in raw:
        return tuple(_tree_in(v, tensors) for v in raw["tuple"])
    if "list" in raw:
        return [_tree_in(v, tensors) for v in raw["list"]]
    return raw["value"]


def encode(entry: TieredContext, fingerprint: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the manifest (less the tensor file's name, size and checksum) of ``entry``."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, (keys, values) in enumerate(zip(entry.keys, entry.values)):
        tensors[f"k.{layer}"] = keys.contiguous()
        tensors[f"v.{layer}"] = values.contiguous()
    positions = _tree_out(list(entry.keep_positions), "pos", tensors)
    snapshot = _tree_out(entry.gdn_snapshot, "gdn", tensors)
    layout = entry.layout
    manifest = {
        "format": FORMAT, "fingerprint": fingerprint,
        "context_ids": list(entry.context_ids), "settings": _settings_json(entry.settings),
        "kept_per_layer": list(entry.kept_per_layer), "num_layers": len(entry.keys),
        "layout": {"num_slots": layout.num_slots, "layers": [_cells_json(c) for c in layout.layers],
                   "heads": None if layout.heads is None else [[_cells_json(c) for c in hs] for hs in layout.heads]},
        "prefix_cells": [_prefix_cells_json(c) for c in entry.prefix_cells],
        "keep_positions": positions, "gdn_snapshot": snapshot,
        "timings": {k: v for k, v in entry.timings.items() if isinstance(v, (int, float))},
        "tenant": entry.tenant, "reuse_count": entry.reuse_count,
    }
    return tensors, manifest


def decode(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TieredContext:
    """``encode``'s inverse; raises on any inconsistency (the caller refuses the file)."""
    raw = manifest["layout"]
    layout = PrefixLayout(int(raw["num_slots"]), tuple(_cells_of(c) for c in raw["layers"]),
                          None if raw["heads"] is None else tuple(tuple(_cells_of(c) for c in hs) for hs in raw["heads"]))
    num_layers = int(manifest["num_layers"])
    keys = [tensors[f"k.{layer}"] for layer in range(num_layers)]
    values = [tensors[f"v.{layer}"] for layer in range(num_layers)]
    for k, v in zip(keys, values):
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != layout.num_slots:
            raise ValueError(f"keys {tuple(k.shape)} / values {tuple(v.shape)} do not hold the layout's "
                             f"{layout.num_slots} slots")
    return TieredContext(
        context_ids=tuple(int(t) for t in manifest["context_ids"]), settings=CompactionSettings(**manifest["settings"]),
        kept_per_layer=[int(k) for k in manifest["kept_per_layer"]], layout=layout, keys=keys, values=values,
        prefix_cells=[_prefix_cells_of(c) for c in manifest["prefix_cells"]],
        keep_positions=_tree_in(manifest["keep_positions"], tensors), gdn_snapshot=_tree_in(manifest["gdn_snapshot"], tensors),
        timings=dict(manifest.get("timings") or {}), tenant=manifest.get("tenant"),
        reuse_count=int(manifest.get("reuse_count") or 0))
