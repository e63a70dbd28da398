"""The file form of a compacted context: its names, its manifest and tensors, and how an untrusted
file is read.

One context is two files in the context directory:
  ``<key>.<digest>.safetensors``  its tensors: per attention layer the kept keys and values over its S
                                   slots (``k.L`` / ``v.L``), the kept positions (``pos.*``) and the
                                   recurrent-state snapshot's tensors (``gdn.*``);
  ``<key>.json``                   the manifest: the format, the model's fingerprint, the token ids, the
                                   settings, the layout and cells, the tenant, the tensor file's name,
                                   size and SHA-256, and (with a secret) an HMAC over all of it.
``key`` is 40 hex digits hashing (fingerprint, token ids, settings); ``digest`` 16 hex digits of the
tensor file's own SHA-256. Temporary files are ``.tmp-<pid>-<ns>-<one of those names>``; the
directory's marker is ``MARKER``. Every other name belongs to someone else and is never touched.

Everything read here is untrusted: a file is opened only if it is a regular file (no FIFO, device
or symlink), without blocking, its size read with ``fstat`` and bounded before a byte is read, and
any fault while parsing it refuses that file only (``RefusedFile``).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from sglang_kvx.compact.layout import Borrowed, LayerCells, PrefixLayout
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.store import PrefixCells
from sglang_kvx.store.tiers import TieredContext

FORMAT = 1  # the manifest's "format": files of another format are not this server's
MARKER = ".sglang-kvx-context-dir"  # written in a directory this server owns
MARKER_TEXT = json.dumps({"format": FORMAT, "what": "sglang_kvx compacted contexts"}) + "\n"
MANIFEST_NAME = re.compile(r"([0-9a-f]{40})\.json")
TENSORS_NAME = re.compile(r"([0-9a-f]{40})\.([0-9a-f]{16})\.safetensors")
TEMP_NAME = re.compile(r"\.tmp-[0-9]+-[0-9]+-(.+)")
MAX_MANIFEST_BYTES = 256 << 20  # a million token ids as JSON is ~8 MB; anything far larger is no manifest of ours
MAX_TOKEN_ID = (1 << 31) - 1


class RefusedFile(Exception):
    """A context file that must not be served; ``reason`` is the counter's key, the message names
    files only (never a path: it may reach a client)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def is_own_name(name: str) -> bool:
    """Whether ``name`` is one a server of this format writes in its directory."""
    temp = TEMP_NAME.fullmatch(name)
    inner = temp.group(1) if temp else name
    # A marker's temporary name counts too: two servers starting at once on one empty directory see
    # each other's marker before it is renamed into place.
    return inner == MARKER or bool(MANIFEST_NAME.fullmatch(inner) or TENSORS_NAME.fullmatch(inner))


def foreign_names(directory: Path) -> list[str]:
    """The names in ``directory`` that no server of this format writes (sorted)."""
    return sorted(name for name in os.listdir(directory) if not is_own_name(name))


def tensors_name_of(key: str, name: Any) -> bool:
    """Whether ``name`` is a tensor file name carrying manifest ``key``'s key (only such a file is ever
    removed with its manifest)."""
    match = TENSORS_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match.group(1) == key


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


def settings_json(settings: CompactionSettings) -> dict[str, Any]:
    out = {"policy": settings.policy, "keep_fraction": settings.keep_fraction,
           "protected_prefix_len": settings.protected_prefix_len, "allocation": settings.allocation}
    if settings.namespace is not None:  # salted contexts hash (and file) their namespace; unsalted ones as before
        out["namespace"] = list(settings.namespace)
    return out


def settings_of(raw: Any) -> CompactionSettings:
    """A manifest's settings, checked (raises ValueError)."""
    if not isinstance(raw, dict) or not {"policy", "keep_fraction", "protected_prefix_len", "allocation"} <= set(raw) <= {
            "policy", "keep_fraction", "protected_prefix_len", "allocation", "namespace"}:
        raise ValueError("settings must hold policy, keep_fraction, protected_prefix_len, allocation (and a namespace)")
    namespace = raw.get("namespace")
    if namespace is not None:
        if not (isinstance(namespace, list) and len(namespace) == 2
                and all(part is None or isinstance(part, str) for part in namespace)):
            raise ValueError("settings.namespace must be [extra_key, cache_salt]")
        namespace = tuple(namespace)
    return CompactionSettings(raw["policy"], raw["keep_fraction"], raw["protected_prefix_len"], raw["allocation"],
                              namespace)


def context_key(fingerprint: str, context_ids: tuple[int, ...], settings: CompactionSettings) -> str:
    digest = hashlib.sha256(fingerprint.encode())
    digest.update(torch.tensor(context_ids, dtype=torch.int64).numpy().tobytes())
    digest.update(json.dumps(settings_json(settings), sort_keys=True).encode())
    return digest.hexdigest()[:40]


def read_secret(path: str) -> bytes | None:
    """The shared secret of ``--kvx-context-secret-file`` (None: none): the file's bytes, stripped of
    surrounding whitespace. Raises ``ValueError`` naming the flag when it cannot serve as one."""
    if not path:
        return None
    try:
        secret = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--kvx-context-secret-file: cannot read it ({exc.strerror})") from None
    if len(secret) < 16:
        raise ValueError(f"--kvx-context-secret-file holds {len(secret)} bytes; a secret needs at least 16")
    return secret


# --- reading an untrusted file -------------------------------------------------------------------


def read_regular(path: Path, *, max_bytes: int | None = None, exact_bytes: int | None = None) -> bytearray:
    """The bytes of ``path`` if it is a regular file of an acceptable size: opened without following a
    symlink and without blocking (a FIFO or device is refused before anything waits on it), its size
    read with ``fstat`` and checked before it is read. Raises ``RefusedFile`` (``not_regular``,
    ``size``) or ``OSError`` (it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile("not_regular", f"{path.name} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RefusedFile("not_regular", f"{path.name} is not a regular file")
        size = info.st_size
        if (max_bytes is not None and size > max_bytes) or (exact_bytes is not None and size != exact_bytes):
            want = f"{exact_bytes} bytes" if exact_bytes is not None else f"at most {max_bytes} bytes"
            raise RefusedFile("size", f"{path.name} holds {size} bytes, its manifest says {want}")
        data = bytearray(size)  # filled in place: no joined copy (readinto releases the GIL)
        view, done = memoryview(data), 0
        with os.fdopen(os.dup(fd), "rb", buffering=0) as stream:
            while done < size:
                got = stream.readinto(view[done:done + (16 << 20)])
                if not got:
                    break
                done += got
        if done != size or os.fstat(fd).st_size != size:
            raise RefusedFile("size", f"{path.name} changed while it was read")
        return data
    finally:
        os.close(fd)


def tensors_of(data: bytearray, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read by ``read_regular``, as views of ``data`` (no copy:
    ``safetensors.torch.load`` copies every tensor holding the GIL, 34 ms for 64 MiB, measured). The
    header is untrusted: every dtype, shape and offset is checked, and the tensors must tile the data
    exactly. Raises ``RefusedFile`` (``bad_tensors``)."""
    try:
        length = int.from_bytes(data[:8], "little")
        if len(data) < 8 or length > len(data) - 8:
            raise ValueError("header length past the end")
        header = json.loads(bytes(data[8:8 + length]))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        header.pop("__metadata__", None)
        start, spans, out = 8 + length, [], {}
        for key, meta in header.items():
            dtype = DTYPE_OF_NAME[meta["dtype"]]
            shape, (low, high) = meta["shape"], meta["data_offsets"]
            if not isinstance(shape, list) or any(type(d) is not int for d in [*shape, low, high]):
                raise ValueError(f"{key}: shape and offsets must be lists of integers")
            count = math.prod(shape)
            if min(shape, default=0) < 0 or high - low != count * dtype.itemsize or low < 0:
                raise ValueError(f"{key}: offsets do not match its shape")
            spans.append((low, high))
            out[key] = (torch.frombuffer(data, dtype=dtype, count=count, offset=start + low).view(shape)
                        if count else torch.empty(shape, dtype=dtype))
        spans.sort()
        if [lo for lo, _ in spans] != [0] + [hi for _, hi in spans[:-1]] or (spans[-1][1] if spans else 0) != len(data) - start:
            raise ValueError("tensors do not tile the data")
        return out
    except Exception as exc:  # noqa: BLE001 - whatever a bad header raises, the file is refused, not served
        raise RefusedFile("bad_tensors", f"{name}: {type(exc).__name__}: {_brief(exc)}") from None


def write_atomic(directory: Path, name: str, data: bytes) -> None:
    """Temporary file, fsync, rename, fsync of the directory: a reader sees the whole file or none."""
    _publish(_write_temp(directory, name, [memoryview(data)]), directory / name)


# safetensors' dtype names (its format: an 8-byte little-endian header length, the JSON header, the data)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
DTYPE_OF_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
WRITE_CHUNK = 4 << 20  # bytes per os.write / hash update: each releases the GIL


@dataclass
class TensorFile:
    """A context's tensor file before it is written: the safetensors header and the tensors whose own
    memory follows it. Nothing is serialised into one buffer: building a 64 MiB ``bytes`` holds the
    GIL for tens of milliseconds (``safetensors.torch.save``: 37 ms at a stretch, measured), which is
    a decode step of the scheduler thread sharing this process; ``write_tensor_file`` streams each
    tensor's bytes in chunks through calls that release it."""

    header: bytes
    tensors: list[torch.Tensor]
    nbytes: int


def tensor_file(tensors: dict[str, torch.Tensor]) -> TensorFile:
    """``tensors`` laid out as a safetensors file (read back by ``safetensors.torch.load``). Raises
    ``ValueError`` for a dtype safetensors has no name for."""
    meta: dict[str, Any] = {}
    ordered, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"no file form for a {tensor.dtype} tensor ({name})")
        size = tensor.numel() * tensor.element_size()
        meta[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                      "data_offsets": [offset, offset + size]}
        ordered.append(tensor)
        offset += size
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    prefix = len(header).to_bytes(8, "little") + header
    return TensorFile(prefix, ordered, len(prefix) + offset)


def write_tensor_file(directory: Path, key: str, file: TensorFile) -> tuple[str, str]:
    """Write ``file`` as ``<key>.<digest>.safetensors`` (atomically, as ``write_atomic``), hashing while
    it writes; returns (its name, its SHA-256). Until the digest is known the temporary file is named
    with 16 zeros in its place (still a name of this server's)."""
    digest = hashlib.sha256()

    def chunks():
        yield memoryview(file.header)
        for tensor in file.tensors:
            if tensor.numel():
                raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                for start in range(0, len(raw), WRITE_CHUNK):
                    yield raw[start:start + WRITE_CHUNK]

    tmp = _write_temp(directory, f"{key}.{'0' * 16}.safetensors", chunks(), digest)
    hexdigest = digest.hexdigest()
    name = f"{key}.{hexdigest[:16]}.safetensors"
    _publish(tmp, directory / name)
    return name, hexdigest


def _write_temp(directory: Path, name: str, chunks: Iterable[memoryview], digest: Any = None) -> Path:
    tmp = directory / f".tmp-{os.getpid()}-{time.monotonic_ns()}-{name}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            for view in chunks:
                if digest is not None:
                    digest.update(view)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        _unlink_quietly(tmp)
        raise
    return tmp


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except OSError:
        _unlink_quietly(tmp)
        raise
    fsync_directory(final.parent)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:  # the error being raised is the one that matters
        pass


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the manifest ----------------------------------------------------------------------------------


@dataclass
class DiskEntry:
    """A context file the directory holds: its manifest, checked; the tensors stay on disk until read."""

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

    @property
    def num_slots(self) -> int:
        return int(self.manifest["layout"]["num_slots"])

    @property
    def per_head(self) -> bool:
        return self.manifest["layout"]["heads"] is not None

    @property
    def tensors(self) -> str:
        return self.manifest["tensors"]


def sign(manifest: dict[str, Any], secret: bytes) -> str:
    """The HMAC-SHA256 of a manifest (all its fields but ``hmac``; the tensor file's digest among them)."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True).encode()
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def owns_manifest(raw: Any, fingerprint: str) -> bool:
    """Whether a parsed manifest is provably a file of this format written for this model (only such a
    file is ever removed when it is refused; anything else is left alone)."""
    return isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("fingerprint") == fingerprint


def parse_manifest(key: str, data: bytes, fingerprint: str, mtime: float, mtime_ns: int,
                   secret: bytes | None) -> DiskEntry:
    """Manifest ``<key>.json``'s bytes, checked: its format, its model, every field's type and range,
    its HMAC (with a secret), its name. Raises ``RefusedFile`` on any fault."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RefusedFile("unreadable_manifest", f"{key}.json is not JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RefusedFile("unreadable_manifest", f"{key}.json is not a format-{FORMAT} context manifest")
    if raw.get("fingerprint") != fingerprint:
        raise RefusedFile("other_model", f"{key}.json was written by a server of another model, tokenizer or KV layout")
    if secret is not None:
        given = raw.get("hmac")
        if not isinstance(given, str) or not hmac.compare_digest(given, sign(raw, secret)):
            raise RefusedFile("bad_signature", f"{key}.json carries no valid HMAC for this server's secret")
    try:
        entry = _entry_of(key, raw, mtime, mtime_ns)
    except RefusedFile:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a hostile manifest makes the parser raise refuses it
        raise RefusedFile("unreadable_manifest", f"{key}.json: {type(exc).__name__}: {_brief(exc)}") from None
    if context_key(fingerprint, entry.context_ids, entry.settings) != key:
        raise RefusedFile("key_mismatch", f"{key}.json: its token ids or settings are not the ones its name hashes")
    return entry


def _entry_of(key: str, raw: dict[str, Any], mtime: float, mtime_ns: int) -> DiskEntry:
    ids = raw["context_ids"]
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise ValueError("context_ids must be a non-empty list of token ids")
    settings = settings_of(raw["settings"])
    if not (isinstance(settings.policy, str) and isinstance(settings.allocation, str)
            and type(settings.keep_fraction) in (int, float) and 0 < settings.keep_fraction <= 1
            and type(settings.protected_prefix_len) is int and 0 <= settings.protected_prefix_len < len(ids)):
        raise ValueError("settings out of range")
    size = raw["tensors_bytes"]
    if type(size) is not int or size <= 0:
        raise ValueError("tensors_bytes must be a positive integer")
    if not tensors_name_of(key, raw["tensors"]):
        raise RefusedFile("bad_tensor_name", f"{key}.json names a tensor file that is not its own")
    digest = raw["tensors_sha256"]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest) or not raw["tensors"].endswith(
            f".{digest[:16]}.safetensors"):
        raise ValueError("tensors_sha256 must be the tensor file's SHA-256, its name's digest")
    layout = raw["layout"]
    if not isinstance(layout, dict) or type(layout.get("num_slots")) is not int or not 0 < layout["num_slots"] <= len(ids):
        raise ValueError("layout.num_slots must be a count of slots within the context")
    tenant = raw.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("tenant must be a string")
    return DiskEntry(key=key, manifest=raw, context_ids=tuple(ids), settings=settings, nbytes=size, last_used=mtime,
                     tenant=tenant, mtime_ns=mtime_ns)


def _brief(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


# --- encoding --------------------------------------------------------------------------------------


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


def _tree_in(raw: dict[str, Any], tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    if depth > 16:
        raise ValueError("the snapshot nests too deep")
    if "tensor" in raw:
        return tensors[raw["tensor"]]
    if "tuple" in raw:
        return tuple(_tree_in(v, tensors, depth + 1) for v in raw["tuple"])
    if "list" in raw:
        return [_tree_in(v, tensors, depth + 1) for v in raw["list"]]
    value = raw["value"]
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise ValueError("a snapshot value must be a scalar")
    return value


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
        "context_ids": list(entry.context_ids), "settings": settings_json(entry.settings),
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
    """``encode``'s inverse; raises on any inconsistency (the caller refuses the file). The values
    are checked against the pool later (``store/fit_check.py``)."""
    raw = manifest["layout"]
    layout = PrefixLayout(int(raw["num_slots"]), tuple(_cells_of(c) for c in raw["layers"]),
                          None if raw["heads"] is None else tuple(tuple(_cells_of(c) for c in hs) for hs in raw["heads"]))
    num_layers = int(manifest["num_layers"])
    keys = [tensors[f"k.{layer}"] for layer in range(num_layers)]
    values = [tensors[f"v.{layer}"] for layer in range(num_layers)]
    return TieredContext(
        context_ids=tuple(int(t) for t in manifest["context_ids"]), settings=settings_of(manifest["settings"]),
        kept_per_layer=[int(k) for k in manifest["kept_per_layer"]], layout=layout, keys=keys, values=values,
        prefix_cells=[_prefix_cells_of(c) for c in manifest["prefix_cells"]],
        keep_positions=_tree_in(manifest["keep_positions"], tensors),
        gdn_snapshot=_tree_in(manifest["gdn_snapshot"], tensors),
        timings={k: float(v) for k, v in (manifest.get("timings") or {}).items() if type(v) in (int, float)},
        tenant=manifest.get("tenant"), reuse_count=max(0, int(manifest.get("reuse_count") or 0)))
