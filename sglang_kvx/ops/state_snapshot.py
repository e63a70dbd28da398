"""Snapshot and restore of per-slot recurrent states (GDN temporal and conv states) for a set of
pool slots: On-Demand Attention saves a row's states before the Local attempt and puts them back
before a Full retry, so the retry starts from the same pre-step state.

SGLang's MambaPool allocates every conv state as [L, S, *conv_shape] and the temporal state as
[L, S, H, V, K] (L mamba layers, S = pool size + 1 slots): the slot dim is 1 there, and 0 in a
layer's view ``conv[layer]`` / ``temporal[layer]``. ``slot_dim`` names it, one int for all the
tensors or one per tensor.

Shapes: states, a list of tensors with S entries along their slot dim; slots [n] (indices into
S; distinct for a restore). ``snapshot_states`` returns, per state, a new contiguous tensor of
the state's shape with n along the slot dim (entry r holds slot ``slots[r]``);
``restore_states`` writes such a snapshot back in place. Copies are bit-exact (the kernels move
raw bits, any dtype).

Dispatch: the CuPy kernel where ``cupy`` imports and the state is on CUDA (CuPy is the optional
``gpu`` extra), else the Triton kernel on CUDA (and under TRITON_INTERPRET=1 when asked for),
else the torch reference (index_select / index_copy_), which is the source of truth. A state
whose dims before or after the slot dim cannot be flattened to one stride each, or whose
trailing dims are not contiguous, takes the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sglang_kvx.ops.dispatch import choose, run

# The kernels copy raw bits: a state is reinterpreted as the integer type of its element size.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def snapshot_states(states: Sequence[torch.Tensor], slots: torch.Tensor,
                    slot_dim: int | Sequence[int] = 0, impl: str | None = None,
                    bounds: str = "host") -> list[torch.Tensor]:
    """impl: see ``ops/dispatch.py`` (op ``state_snapshot``; auto: CuPy, else Triton on CUDA; torch elsewhere).
    ``bounds``: how a slot outside the states is refused -- ``"host"``, a ValueError before any launch (one
    host read of the least and greatest slot); ``"device"``, an assertion the device checks in order with
    the copies (no host read: for slots taken from the engine's own mapping, where a bad one is a bug, on
    CUDA a device-side assertion error; on CPU a RuntimeError)."""
    if bounds not in ("host", "device"):
        raise ValueError(f"bounds must be 'host' or 'device', got {bounds!r}")
    dims = _slot_dims(states, slot_dim)
    indices = _check_slots(slots, states, dims, read_bounds=bounds == "host", assert_on_device=bounds == "device")
    snapshots = []
    for state, dim, index in zip(states, dims, indices):
        shape = list(state.shape)
        shape[dim] = index.numel()
        snapshot = torch.empty(shape, dtype=state.dtype, device=state.device)
        src, dst = _rows_view(state, dim), _rows_view(snapshot, dim)
        chosen = choose("state_snapshot", impl, state.device)
        if src is None or index.numel() == 0:
            chosen = "torch"  # no raw-bits view of this state: the reference copies it

        def reference(*_, state=state, dim=dim, index=index, snapshot=snapshot, **__):
            torch.index_select(state, dim, index, out=snapshot)

        run("state_snapshot", impl, chosen, reference, _KERNELS, src, dst, index, scatter=False)
        snapshots.append(snapshot)
    return snapshots


def restore_states(states: Sequence[torch.Tensor], slots: torch.Tensor, snapshot: Sequence[torch.Tensor],
                   slot_dim: int | Sequence[int] = 0, impl: str | None = None, bounds_checked: bool = False) -> None:
    """Write ``snapshot`` (from ``snapshot_states`` with the same slots) back into ``states`` in place.
    ``bounds_checked``: the slots are (some of) those the snapshot was taken at, checked then: not read back again."""
    dims = _slot_dims(states, slot_dim)
    if len(snapshot) != len(states):
        raise ValueError(f"{len(snapshot)} snapshots for {len(states)} states")
    indices = _check_slots(slots, states, dims, read_bounds=not bounds_checked)
    for state, saved, dim, index in zip(states, snapshot, dims, indices):
        want = list(state.shape)
        want[dim] = index.numel()
        if list(saved.shape) != want or saved.dtype != state.dtype or saved.device != state.device:
            raise ValueError(f"a snapshot {tuple(saved.shape)} {saved.dtype} does not fit state "
                             f"{tuple(state.shape)} {state.dtype} at slot dim {dim} with {index.numel()} slots")
        src, dst = _rows_view(saved, dim), _rows_view(state, dim)
        chosen = choose("state_snapshot", impl, state.device)
        if src is None or dst is None or index.numel() == 0:
            chosen = "torch"

        def reference(*_, state=state, dim=dim, index=index, saved=saved, **__):
            state.index_copy_(dim, index, saved)

        run("state_snapshot", impl, chosen, reference, _KERNELS, src, dst, index, scatter=True)


def _slot_dims(states: Sequence[torch.Tensor], slot_dim: int | Sequence[int]) -> list[int]:
    dims = [slot_dim] * len(states) if isinstance(slot_dim, int) else list(slot_dim)
    if len(dims) != len(states):
        raise ValueError(f"{len(dims)} slot dims for {len(states)} states")
    out = []
    for state, dim in zip(states, dims):
        if not -state.dim() <= dim < state.dim():
            raise ValueError(f"slot dim {dim} is out of range for a state of shape {tuple(state.shape)}")
        out.append(dim % state.dim())
    return out


def _check_slots(slots: torch.Tensor, states: Sequence[torch.Tensor], dims: list[int],
                 read_bounds: bool = True, assert_on_device: bool = False) -> list[torch.Tensor]:
    """The slots as int64 on each state's device, bound-checked against every state (``read_bounds``: on the
    host; ``assert_on_device``: by the device, no host read)."""
    if slots.dim() != 1:
        raise ValueError(f"slots must be one-dimensional, got shape {tuple(slots.shape)}")
    index = slots.to(torch.long).contiguous()
    # The kernels do not bound-check their loads and stores: refuse a bad slot before launching
    # (one host sync per call -- the least and greatest slot read back together -- not one per state).
    size = min((state.shape[dim] for state, dim in zip(states, dims)), default=0)
    if read_bounds and index.numel():
        low, high = torch.stack([index.min(), index.max()]).tolist()
        if low < 0 or high >= size:
            raise ValueError(f"slots must lie in [0, {size})")
    elif assert_on_device and index.numel():
        torch._assert_async(((index >= 0) & (index < size)).all(), f"state snapshot: slots must lie in [0, {size})")
    on_device: dict[torch.device, torch.Tensor] = {}
    for state in states:  # one copy per device, not per state
        if state.device not in on_device:
            on_device[state.device] = index.to(state.device)
    return [on_device[state.device] for state in states]


def _rows_view(t: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``t`` as [outer, S, inner] raw integers with a contiguous inner dim, or None if no such view exists."""
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1:])
    try:
        view = t.view(outer, t.shape[dim], inner)
    except RuntimeError:  # the dims around the slot dim do not flatten to one stride
        return None
    if inner > 1 and view.stride(2) != 1:
        return None
    return view.view(_BITS[t.element_size()]) if t.element_size() in _BITS else None


def _cupy(*args, **kwargs):
    from sglang_kvx.ops.cupy_state_snapshot import copy_rows_cupy

    return copy_rows_cupy(*args, **kwargs)


def _triton(*args, **kwargs):
    from sglang_kvx.ops.triton_state_snapshot import copy_rows_triton

    return copy_rows_triton(*args, **kwargs)


# The kernels copy rows of raw-bits views (src, dst, index, scatter); the reference copies the states themselves.
_KERNELS = {"cupy": _cupy, "triton": _triton}
