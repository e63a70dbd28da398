"""Counting what would make a GPU wait for the host, on any device (issue #56 item 3).

On CUDA these calls block the host until the device has caught up, or start a host-to-device copy
the device then waits on: reading a value (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``), ops
whose output size depends on the data (``nonzero``, ``unique``, indexing by a boolean mask,
``repeat_interleave`` without ``output_size``), and building a tensor from host data
(``torch.tensor``, ``torch.as_tensor``). On a CPU nothing waits, but the calls are the same, so a
counter over one forward measures on this machine what a GPU would pay. ``HostSyncCounter`` is a
``TorchFunctionMode``: it sees every such call made from Python, ours and SGLang's alike (compare a
batch against a plain batch of the same size to read off one's own).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
          torch.Tensor.__int__: "item", torch.Tensor.__float__: "item", torch.Tensor.__index__: "item",
          torch.Tensor.cpu: "cpu"}
_DATA_SIZED = {torch.nonzero: "nonzero", torch.Tensor.nonzero: "nonzero", torch.unique: "unique",
               torch.Tensor.unique: "unique", torch.argwhere: "nonzero", torch.masked_select: "masked_select",
               torch.Tensor.masked_select: "masked_select"}
_FROM_HOST = {torch.tensor: "tensor_from_host", torch.as_tensor: "tensor_from_host"}
_REPEAT = (torch.repeat_interleave, torch.Tensor.repeat_interleave)
_INDEX = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _is_bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as counter: ...``; ``counter.counts`` by kind, ``counter.total``."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        # With ``where``: also by the calling line outside torch (``kind@path:line``), to find each one.
        self.where: Counter[str] | None = Counter() if where else None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func) or _DATA_SIZED.get(func) or _FROM_HOST.get(func)
        if kind is None and func in _REPEAT and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            kind = "repeat_interleave" if isinstance(repeats, torch.Tensor) else None
        if kind is None and func in _INDEX and len(args) > 1 and _is_bool_mask(args[1]):
            kind = "bool_index"
        if kind is not None:
            self.counts[kind] += 1
            if self.where is not None:
                self.where[f"{kind}@{_caller()}"] += 1
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame outside torch and this module, as ``path:line`` from ``site-packages`` or the
    package folder on."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for anchor in ("site-packages/", "/sglang_kvx/"):
        if anchor in path:
            path = path.split(anchor, 1)[1] if anchor == "site-packages/" else "sglang_kvx/" + path.split(anchor, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def host_values(tensor: torch.Tensor) -> list:
    """The values of a tensor kept on the host on every device (SGLang's ``*_cpu`` mirrors of a batch's
    lengths and rows): read without waiting for a device. ``numpy()`` refuses a device tensor, so a mirror
    that ever moved to the GPU fails here loudly instead of syncing quietly; not counted as a sync."""
    return tensor.numpy().tolist()


def device_positions(positions: list[int], device: torch.device | str) -> torch.Tensor:
    """Host-known positions, in their order, as an int64 index on ``device`` without a host-to-device copy: each
    run of consecutive positions is an ``arange`` whose bounds travel as kernel arguments, as a slice's do
    (a sub-batch's rows: at most one run per row, usually a few)."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and position == runs[-1][1]:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    if not runs:
        return torch.empty(0, dtype=torch.long, device=device)
    pieces = [torch.arange(start, end, dtype=torch.long, device=device) for start, end in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
