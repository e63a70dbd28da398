"""Whether a context held outside the pool can go back into it: checked before a single slot is taken.

A context read from a file is untrusted even when its checksum holds (a writer with access to the
directory can recompute one): its tensors must have the pool's dtype and entry shape, hold finite
values (an infinite key or a NaN state changes every answer that reads it), and its layout, cells,
positions and recurrent-state snapshot must describe exactly what this pool and state pool hold.
``misfit`` says why not, in one line naming no path; None when it fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_kvx.compact.layout import LayerCells
from sglang_kvx.ports import KVPool
from sglang_kvx.store.tiers import TieredContext


@dataclass(frozen=True)
class PoolFacts:
    """What a context must match to go into one pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_ids: tuple[int, ...]  # the model's layer index of each attention layer (what cells name)
    state_template: Any = None  # one slot's recurrent-state snapshot (None: the model has no such state)

    @classmethod
    def of(cls, pool: KVPool) -> "PoolFacts":
        return cls(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype,
                   tuple(pool.layer_id(i) for i in range(pool.num_layers)),
                   pool.state_template() if pool.has_state else None)


def misfit(entry: TieredContext, facts: PoolFacts, values: bool = True) -> str | None:
    """Why ``entry`` cannot go into a pool of ``facts`` (``values``: its numbers are checked too)."""
    for check in (_tensors, _layout, _cells, _positions, _snapshot):
        problem = check(entry, facts, values)
        if problem is not None:
            return problem
    return None


def _tensors(entry: TieredContext, facts: PoolFacts, values: bool) -> str | None:
    if len(entry.keys) != facts.num_layers or len(entry.values) != facts.num_layers:
        return f"{len(entry.keys)} attention layers of keys, the pool has {facts.num_layers}"
    shape = (entry.layout.num_slots, facts.num_kv_heads, facts.head_dim)
    for layer, (keys, vals) in enumerate(zip(entry.keys, entry.values)):
        for what, tensor in (("keys", keys), ("values", vals)):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != facts.dtype or tuple(tensor.shape) != shape:
                got = (tensor.dtype, tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                return f"layer {layer} {what} are {got}, the pool holds {facts.dtype} entries of shape {shape}"
            if values and not bool(torch.isfinite(tensor).all()):
                return f"layer {layer} {what} hold non-finite values"
    return None


def _cells_fit(cells: LayerCells, slots: int, layers: int, heads: int | None) -> bool:
    if not 0 <= cells.own <= slots:
        return False
    for b in cells.borrowed:
        if not (0 <= b.layer < layers and 0 <= b.start <= b.end <= slots):
            return False
        if (b.head is None) != (heads is None) or (heads is not None and not 0 <= b.head < heads):
            return False
    return True


def _layout(entry: TieredContext, facts: PoolFacts, values: bool) -> str | None:
    layout, slots, layers = entry.layout, entry.layout.num_slots, facts.num_layers
    if not 0 < slots <= entry.n or len(entry.kept_per_layer) != layers:
        return f"a layout of {slots} slots and {len(entry.kept_per_layer)} layers for a {entry.n}-token context"
    if layout.heads is None:
        if len(layout.layers) != layers or not all(_cells_fit(c, slots, layers, None) for c in layout.layers):
            return "its layout's cells lie outside its slots or layers"
        kept = [c.kept for c in layout.layers]
    else:
        if len(layout.heads) != layers or any(len(h) != facts.num_kv_heads for h in layout.heads) or not all(
                _cells_fit(c, slots, layers, facts.num_kv_heads) for h in layout.heads for c in h):
            return "its per-head layout's cells lie outside its slots, layers or heads"
        kept = [max(c.kept for c in h) for h in layout.heads]
    if kept != list(entry.kept_per_layer) or any(not 0 <= k <= entry.n for k in kept):
        return f"its kept counts {list(entry.kept_per_layer)} disagree with its layout ({kept})"
    return None


def _cells(entry: TieredContext, facts: PoolFacts, values: bool) -> str | None:
    cells, layout = entry.prefix_cells, entry.layout
    if len(cells) not in (0, facts.num_layers):
        return f"cells for {len(cells)} layers, the pool has {facts.num_layers}"
    for layer, cell in enumerate(cells):
        if cell is None:
            continue
        if cell.num_slots != layout.num_slots or not 0 <= cell.own <= layout.num_slots:
            return f"layer {layer}'s cells do not match its layout"
        if layout.heads is None:
            if cell.head_borrowed is not None or len(cell.borrowed) != len(layout.layers[layer].borrowed) or any(
                    layer_id not in facts.layer_ids for layer_id, _ in cell.borrowed):
                return f"layer {layer}'s borrowed cells do not match its layout"
        elif cell.head_borrowed is None or len(cell.head_borrowed) != facts.num_kv_heads or any(
                len(ranges) != len(layout.heads[layer][h].borrowed)
                or any(layer_id not in facts.layer_ids or not 0 <= head < facts.num_kv_heads for layer_id, head, _ in ranges)
                for h, ranges in enumerate(cell.head_borrowed)):
            return f"layer {layer}'s per-head borrowed cells do not match its layout"
    return None


def _positions(entry: TieredContext, facts: PoolFacts, values: bool) -> str | None:
    positions = entry.keep_positions
    if len(positions) not in (0, facts.num_layers):
        return f"kept positions for {len(positions)} layers, the pool has {facts.num_layers}"
    for layer, kept in enumerate(positions):
        tensors = kept if isinstance(kept, list) else [kept]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or (
                    t.numel() and not (int(t.min()) >= 0 and int(t.max()) < entry.n)):
                return f"layer {layer}'s kept positions are not positions of the {entry.n}-token context"
    return None


def _snapshot(entry: TieredContext, facts: PoolFacts, values: bool) -> str | None:
    if facts.state_template is None:
        return None if entry.gdn_snapshot is None else "a recurrent-state snapshot for a model without one"
    if entry.gdn_snapshot is None:
        return "no recurrent-state snapshot, which this model's children start from"
    return _same_tree(entry.gdn_snapshot, facts.state_template, values, "snapshot")


def _same_tree(value: Any, template: Any, values: bool, where: str) -> str | None:
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.dtype != template.dtype or value.shape != template.shape:
            got = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
            return f"the recurrent-state {where} is {got}, the state pool's is {(template.dtype, tuple(template.shape))}"
        if values and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"the recurrent-state {where} holds non-finite values"
        return None
    if isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            return f"the recurrent-state {where} is not shaped like the state pool's"
        for i, (v, t) in enumerate(zip(value, template)):
            if problem := _same_tree(v, t, values, f"{where}[{i}]"):
                return problem
        return None
    return None if value == template or template is None else f"the recurrent-state {where} differs from the pool's"
