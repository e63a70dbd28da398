"""Re-folding a running row after learned-gate eviction: the memory deleted entries held goes back
to the pool (issue 15, item 3).

Learned-gate eviction deletes entries per layer (layer l + 1 drops the positions whose gate g^(l) is
below tau; layer 0 keeps all), so no pool slot -- which spans every layer's buffer -- is ever empty
in all layers. Re-folding moves a stretch of a row's positions into fresh slots laid out like a
compacted context (``layout.fold_layers``): the stretch's kept entries, layer l's K_l of them, fill
S = ceil(sum_l K_l / L) slots, each layer first in its own buffer, a layer with more than S in the
cells others leave empty. The stretch's old slots -- and a previous fold's -- go back to the pool.
Attention then reads the fold's cells instead of the stretch (``ops/gated_attention.FoldedKeys``).
Each gate travels with its entry (``gates[buffer, slot]``, parallel to the KV buffers).

Only a row's own positions are folded (the prefix cache's stay where they are, shared); folding
grows from one start: each fold takes the previous one's entries and the positions written since.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvx.compact.layout import PrefixLayout, fold_layers
from sglang_kvx.ports import KVPool


@dataclass
class FoldedRow:
    slots: torch.Tensor  # the pool slots the fold holds (S)
    layout: PrefixLayout
    start: int  # row positions [start, end) live in the fold now
    end: int
    deleted_prompt: list[int] = field(default_factory=list)  # per layer, deleted entries that were prompt positions
    deleted_generated: list[int] = field(default_factory=list)  # ... and generated ones
    folds: int = 1  # how many times the row was folded into this

    def kept(self, layer: int) -> int:
        return self.layout.layers[layer].kept

    def cells(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """Where attention layer ``layer``'s kept entries are, in rank order: (buffer layer, slots)."""
        cells = self.layout.layers[layer]
        pieces = [(layer, self.slots[: cells.own])] if cells.own else []
        pieces += [(b.layer, self.slots[b.start : b.end]) for b in cells.borrowed]
        return pieces


def read_folded(fold: FoldedRow, layer: int, pool: KVPool, gates: torch.Tensor, gated: bool):
    """Attention layer ``layer``'s kept entries of a fold: keys, values and (``gated``) gates."""
    keys, values, gate = [], [], []
    for buffer, slots in fold.cells(layer):
        k, v = pool.read(buffer, slots)
        keys.append(k)
        values.append(v)
        gate.append(gates[pool.layer_id(buffer), slots])
    if not keys:
        k, v = pool.read(layer, torch.zeros(0, dtype=torch.long, device=pool.device))
        return k, v, (gates[0, :0] if gated else None)
    return torch.cat(keys), torch.cat(values), (torch.cat(gate) if gated else None)


def fold_row(pool: KVPool, gates: torch.Tensor, row_slots: torch.Tensor, start: int, end: int, prompt_len: int,
             tau: float, previous: FoldedRow | None) -> FoldedRow | None:
    """Fold a row's positions [start, end) (``row_slots`` = the row's slots of [0, end)) with the
    previous fold's entries; returns the new fold, or None when the pool has no room for it now.
    Layer 0 (no gate) keeps every position; layer l keeps those with gates[layer_id(l), slot] >= tau."""
    num_layers = pool.num_layers
    new_from = previous.end if previous is not None else start
    fresh = row_slots[new_from:end]
    positions = torch.arange(new_from, end, device=fresh.device)
    kept_fresh = []
    deleted_prompt = list(previous.deleted_prompt) if previous is not None else [0] * num_layers
    deleted_generated = list(previous.deleted_generated) if previous is not None else [0] * num_layers
    for layer in range(num_layers):
        if layer == 0:
            keep = torch.ones(fresh.numel(), dtype=torch.bool, device=fresh.device)
        else:
            keep = gates[pool.layer_id(layer), fresh] >= tau
        kept_fresh.append(keep)
        gone = ~keep
        deleted_prompt[layer] += int((gone & (positions < prompt_len)).sum())
        deleted_generated[layer] += int((gone & (positions >= prompt_len)).sum())
    counts = [(previous.kept(layer) if previous is not None else 0) + int(kept_fresh[layer].sum())
              for layer in range(num_layers)]
    layout = fold_layers(counts)
    slots = pool.alloc(layout.num_slots)
    if slots is None:
        return None
    fold = FoldedRow(slots, layout, start, end, deleted_prompt, deleted_generated,
                     folds=previous.folds + 1 if previous is not None else 1)
    for layer in range(num_layers):
        gated = layer > 0
        old = read_folded(previous, layer, pool, gates, gated) if previous is not None else None
        k, v = pool.read(layer, fresh[kept_fresh[layer]])
        g = gates[pool.layer_id(layer), fresh[kept_fresh[layer]]]
        if old is not None:
            k, v = torch.cat([old[0], k]), torch.cat([old[1], v])
            g = torch.cat([old[2], g]) if gated else g
        at = 0
        for buffer, cells in fold.cells(layer):
            n = cells.numel()
            pool.write(buffer, cells, k[at : at + n], v[at : at + n])
            if gated:
                gates[pool.layer_id(buffer), cells] = g[at : at + n]
            at += n
    if previous is not None:
        pool.free(previous.slots)
    pool.free(fresh)
    return fold
