"""Where a compacted context's kept entries live in SGLang's pool, layer by layer.

SGLang's allocator hands out slots that span every layer's buffer. A context whose
attention layers keep different numbers of entries K_l (PyramidKV, gate budgets)
would need max_l K_l slots and leave layer l's cells past K_l empty, so it would
free less than (1 - p) of its memory. Instead the layers are folded: the context
holds S = ceil(sum_l K_l / L) slots; layer l keeps its ranks [0, min(K_l, S)) in
its own buffer, and a layer with K_l > S stores its remaining ranks in the cells
other layers leave empty ([K_j, S) of layer j's buffer). Attention for a folded
layer reads those borrowed cells as well (``adapter/attention.py``).

Per-head budgets (an allocation that reads scores, ``allocate.head_budgets``) fold the same way
over (layer, KV head) cells (``fold_heads``): S = ceil(sum_lh K_lh / (L * H)); head h of layer l
keeps its first min(K_lh, S) ranks in its own cells and the rest in cells another (layer, head)
leaves empty, which its attention reads as extra entries of that head.

Flat budgets fold to the plain layout (S = K, each layer its own first K cells),
which every SGLang backend reads unchanged. Folding needs every attention layer's
buffer to have the same entry shape and dtype; otherwise a context holds max_l K_l
slots and only masks (``fold=False``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Borrowed:
    """Ranks of one layer stored in another layer's buffer, at the context's slots [start, end)."""

    layer: int  # index (among the attention layers) of the buffer holding them
    start: int
    end: int
    head: int | None = None  # per-head layouts: the KV head of that buffer holding them (None: every head)

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LayerCells:
    own: int  # ranks [0, own) sit in the layer's own buffer at the context's slots [0, own)
    borrowed: tuple[Borrowed, ...] = ()  # ranks own, own + 1, ... in this order

    @property
    def kept(self) -> int:
        return self.own + sum(b.size for b in self.borrowed)


@dataclass(frozen=True)
class PrefixLayout:
    num_slots: int
    layers: tuple[LayerCells, ...]
    # Per-head layouts (``fold_heads``): per layer, each KV head's cells; ``layers`` is then empty.
    heads: tuple[tuple[LayerCells, ...], ...] | None = None

    @property
    def per_head(self) -> bool:
        return self.heads is not None

    @property
    def num_layers(self) -> int:
        return len(self.heads) if self.heads is not None else len(self.layers)

    def is_plain(self, layer: int) -> bool:
        """Whether layer ``layer`` reads exactly the context's slots, as any SGLang backend does."""
        cells = self.heads[layer] if self.heads is not None else (self.layers[layer],)
        return all(c.own == self.num_slots and not c.borrowed for c in cells)

    @property
    def is_all_plain(self) -> bool:
        return all(self.is_plain(layer) for layer in range(self.num_layers))

    @property
    def borrowed_entries(self) -> int:
        """Ranks kept in another layer's (per-head layouts: another head's) empty cells; per-head
        cells count as 1 / H of an entry each, rounded up."""
        if self.heads is not None:
            cells = sum(b.size for layer in self.heads for c in layer for b in c.borrowed)
            return -(-cells // len(self.heads[0]))
        return sum(b.size for cells in self.layers for b in cells.borrowed)


def fold_layers(kept_per_layer: list[int], fold: bool = True) -> PrefixLayout:
    """The layout of a context keeping ``kept_per_layer[l]`` entries in attention layer l."""
    if not kept_per_layer or min(kept_per_layer) < 0:
        raise ValueError(f"kept entries per layer must be non-negative, got {kept_per_layer}")
    if not fold:
        num_slots = max(kept_per_layer)
        return PrefixLayout(num_slots, tuple(LayerCells(kept) for kept in kept_per_layer))
    num_layers = len(kept_per_layer)
    num_slots = -(-sum(kept_per_layer) // num_layers)
    # Empty cells, as (layer, start, end), in layer order: where overflowing ranks go.
    free = [[j, kept, num_slots] for j, kept in enumerate(kept_per_layer) if kept < num_slots]
    layers = []
    for kept in kept_per_layer:
        own = min(kept, num_slots)
        missing, borrowed = kept - own, []
        while missing:
            cell = free[0]
            take = min(missing, cell[2] - cell[1])
            borrowed.append(Borrowed(cell[0], cell[1], cell[1] + take))
            cell[1] += take
            missing -= take
            if cell[1] == cell[2]:
                free.pop(0)
        layers.append(LayerCells(own, tuple(borrowed)))
    return PrefixLayout(num_slots, tuple(layers))


def fold_heads(kept_per_head: list[list[int]]) -> PrefixLayout:
    """The layout of a context whose KV head h of attention layer l keeps ``kept_per_head[l][h]``
    entries: ``fold_layers`` over the (layer, head) cells, in layer-major order."""
    if not kept_per_head or not kept_per_head[0] or len({len(heads) for heads in kept_per_head}) != 1:
        raise ValueError(f"kept entries must be given for the same number of KV heads in every layer, got {kept_per_head}")
    num_heads = len(kept_per_head[0])
    units = fold_layers([k for heads in kept_per_head for k in heads])
    cells = [LayerCells(c.own, tuple(Borrowed(b.layer // num_heads, b.start, b.end, b.layer % num_heads) for b in c.borrowed))
             for c in units.layers]
    heads = tuple(tuple(cells[l * num_heads : (l + 1) * num_heads]) for l in range(len(kept_per_head)))
    return PrefixLayout(units.num_slots, (), heads)
