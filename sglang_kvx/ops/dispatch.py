"""Which implementation an op runs: one rule for every op of the kernel layer.

Every op has a torch reference (the source of truth; runs anywhere) and some of Triton, FlashInfer
and CuPy for CUDA. ``choose(op, impl, device)`` picks one, in this order:

1. the op's ``impl`` argument, when it is given and not ``"auto"``;
2. ``SGLANG_KVX_OPS_IMPL``, the one override: comma-separated ``op=impl`` entries and at most one
   bare ``impl`` that applies to every op offering it (``triton``; ``window_attention=torch,triton``);
3. auto: on CUDA the first of the op's implementations (``OPS``, in order of preference) whose package
   imports and that takes the call (``supports``); elsewhere the torch reference.

An implementation asked for by name (argument or environment) that cannot run the call raises
RuntimeError saying what it needs; one the op does not offer raises ValueError. Triton runs on CPU
tensors only under ``TRITON_INTERPRET=1`` (its interpreter, used by the tests).

An implementation chosen by auto or the environment that raises (``run``), or that fails its check at
start (``ops/warmup.py``), is replaced by the torch reference for the rest of the process: the call is
answered by the reference, the failure logged once and listed by ``fallbacks`` (``/kvx/stats``). Other
implementations can be registered by name (``register_implementation``: a plugin's kernel, a test's).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_KVX_OPS_IMPL"
OPS: dict[str, tuple[str, ...]] = {  # op -> its implementations, auto's order of preference on CUDA
    "window_attention": ("flashinfer", "triton", "torch"),
    "prefix_attention": ("triton", "torch"),
    "gated_attention": ("triton", "torch"),
    "gatesight_utility": ("triton", "torch"),
    "state_snapshot": ("cupy", "triton", "torch"),
    "block_compress": ("cupy", "triton", "torch"),
    "block_select": ("triton", "torch"),
    "block_sparse_attention": ("flashinfer", "triton", "torch"),
}
_NAMES = {"triton": "Triton", "flashinfer": "FlashInfer", "cupy": "CuPy", "torch": "torch"}
_RETIRED = {"SGLANG_KVX_BLOCK_SPARSE_IMPL": "block_sparse_attention", "SGLANG_KVX_GATED_ATTENTION_IMPL": "gated_attention"}

# A call's own limits: given an implementation's name, None when the call can run there, else why not.
Supports = Callable[[str], "str | None"]

_EXTRA: dict[str, dict[str, Callable]] = {}  # op -> implementations registered from outside, by name
_FALLEN_BACK: dict[str, dict] = {}  # op -> what failed: {"impl", "error", "where"}; it runs its reference since


def register_implementation(op: str, name: str, fn: Callable) -> None:
    """Another implementation of ``op``, called with the op's reference's arguments; chosen only by name (the
    ``impl`` argument or ``SGLANG_KVX_OPS_IMPL``), never by auto."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (one of {', '.join(OPS)})")
    _EXTRA.setdefault(op, {})[name] = fn
    if name not in OPS[op]:
        OPS[op] = (*OPS[op], name)
    _parse.cache_clear()


def fall_back(op: str, impl: str, error: BaseException | str, where: str) -> None:
    """``op``'s ``impl`` failed (``where``: at the warm-up, in a forward): its reference serves it from now on."""
    if op in _FALLEN_BACK:
        return
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {str(error)[:200]}"
    _FALLEN_BACK[op] = {"impl": impl, "error": reason, "where": where}
    logger.warning("sglang_kvx: op %s: the %s implementation failed %s (%s); the torch reference serves it "
                   "for the rest of this process", op, impl, "at its start-up check" if where == "warm-up" else
                   "inside a forward", reason)


def fallbacks() -> dict[str, dict]:
    """Every op that fell back to its reference in this process, with what failed where."""
    return {op: dict(entry) for op, entry in _FALLEN_BACK.items()}


def run(op: str, impl: str | None, chosen: str, reference: Callable, implementations: dict[str, Callable],
        *args, **kwargs):
    """Call ``op``'s ``chosen`` implementation (one of ``implementations``, or one registered) with the
    reference's arguments. When one chosen by auto or the environment raises, the reference answers the call
    and serves the op from now on; one the caller named (``impl``: a test of that kernel) raises."""
    if chosen == "torch":
        return reference(*args, **kwargs)
    fn = implementations.get(chosen) or _EXTRA.get(op, {}).get(chosen)
    if fn is None:
        raise ValueError(f"{op}: no implementation {chosen!r}")
    if impl not in (None, "auto"):
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - contained: the reference answers, the failure is reported
        fall_back(op, chosen, exc, "forward")
        return reference(*args, **kwargs)


def choose(op: str, impl: str | None, device: torch.device, supports: Supports | None = None) -> str:
    """The implementation ``op`` runs for a call on ``device`` (see the module doc)."""
    offers = OPS[op]
    if impl in (None, "auto") and op in _FALLEN_BACK:
        return "torch"  # its chosen implementation failed in this process
    asked = impl if impl not in (None, "auto") else _from_env(op)
    if asked is None:  # auto
        if device.type != "cuda":
            return "torch"
        for name in offers:
            if name == "torch" or (_missing(name, device) is None and (supports is None or supports(name) is None)):
                return name
    if asked not in offers:
        raise ValueError(f"{op}: impl must be one of auto, {', '.join(offers)}; got {asked!r}")
    if asked != "torch":
        why = _missing(asked, device) or (supports(asked) if supports is not None else None)
        if why is not None:
            raise RuntimeError(f"the {_NAMES.get(asked, asked)} {op.replace('_', ' ')} needs {why}")
    return asked


def where_offered(op: str, impl: str | None) -> str | None:
    """``impl`` when ``op`` offers it, else None (auto): one argument steering an op built of several."""
    return impl if impl in OPS[op] else None


def cupy_available() -> bool:
    """CuPy imports and sees a CUDA device."""
    return _importable("cupy")


def triton_available() -> bool:
    return _importable("triton")


def flashinfer_available() -> bool:
    return _importable("flashinfer")


def _missing(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device`` at all, or None."""
    if name == "triton":
        if not _importable("triton"):
            return "triton installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "CUDA tensors (or TRITON_INTERPRET=1 to run it on CPU)"
        return None
    if name == "cupy":
        return None if device.type == "cuda" and _importable("cupy") else "cupy (the optional 'gpu' extra) and CUDA tensors"
    if name == "flashinfer":
        return None if device.type == "cuda" and _importable("flashinfer") else "flashinfer and CUDA tensors"
    return None


def _importable(package: str) -> bool:
    # Read through sys.modules each call: a test may put a stand-in module there.
    module = sys.modules.get(package)
    if module is not None:
        return package != "cupy" or _cupy_has_device(module)
    return _import_once(package)


@functools.cache
def _import_once(package: str) -> bool:
    try:
        module = __import__(package)
    except Exception:  # not installed, or a broken CUDA toolchain (raises more than ImportError)
        return False
    return package != "cupy" or _cupy_has_device(module)


def _cupy_has_device(cupy) -> bool:
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # installed without a usable CUDA driver
        return False


def _from_env(op: str) -> str | None:
    for retired, name in _RETIRED.items():
        if os.environ.get(retired):
            raise ValueError(f"{retired} was replaced by {ENV} (e.g. {ENV}={name}=torch)")
    return _parse(os.environ.get(ENV, "")).get(op)


@functools.lru_cache(maxsize=8)
def _parse(value: str) -> dict[str, str]:
    """``SGLANG_KVX_OPS_IMPL`` as {op: impl} (a bare impl filled in for every op offering it)."""
    chosen: dict[str, str] = {}
    bare = None
    for entry in filter(None, (part.strip() for part in value.split(","))):
        op, sep, impl = entry.partition("=")
        if not sep:
            op, impl = None, entry
        if impl not in ("auto", *_NAMES, *(name for extra in _EXTRA.values() for name in extra)):
            raise ValueError(f"{ENV}: {entry!r}: the implementation must be one of auto, {', '.join(_NAMES)}")
        if op is None:
            if bare is not None:
                raise ValueError(f"{ENV}: two bare implementations ({bare!r}, {impl!r}); name the op as op=impl")
            bare = impl
        elif op not in OPS:
            raise ValueError(f"{ENV}: {entry!r}: unknown op {op!r} (one of {', '.join(OPS)})")
        elif impl not in ("auto", *OPS[op]):
            raise ValueError(f"{ENV}: {entry!r}: {op} offers {', '.join(OPS[op])}")
        else:
            chosen[op] = impl
    if bare not in (None, "auto"):
        for op, offers in OPS.items():
            if bare in offers:
                chosen.setdefault(op, bare)
    return {op: impl for op, impl in chosen.items() if impl != "auto"}
