"""The indexer's compressed keys under ``--kvx-sparse-attention``, kept per request row and layer.

A row's keys only grow while its request runs (a plain row's slots, or a child's kept entries of
the layer followed by its own tokens), so the compressed key of a block whose four entries are
written never changes: each forward builds only the blocks past the last complete one (the prefill
builds them all; decode one every fourth step, plus the partial block the current token is in).
A child's regrouped prefix blocks are built once, at its first forward. A row's index is dropped
when a request enters or leaves it.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.block_sparse import BLOCK


class SparseIndex:
    def __init__(self) -> None:
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # row -> attention layer -> [complete blocks, Hkv, D]
        self.blocks_built = 0  # compressed keys built, over all rows and layers (fresh, not reused)

    def known(self, row: int, layer: int) -> torch.Tensor | None:
        return self.rows.get(row, {}).get(layer)

    def keep(self, row: int, layer: int, block_keys: torch.Tensor, num_keys: int) -> None:
        """Keep the compressed keys of the row's complete blocks (``num_keys`` entries in all)."""
        previous = self.known(row, layer)
        self.blocks_built += block_keys.shape[0] - (previous.shape[0] if previous is not None else 0)
        self.rows.setdefault(row, {})[layer] = block_keys[: num_keys // BLOCK]

    def forget(self, row: int) -> None:
        self.rows.pop(row, None)

    def blocks_per_layer(self) -> dict[int, int]:
        """Compressed keys held now, per attention layer, over the running rows."""
        held: dict[int, int] = {}
        for layers in self.rows.values():
            for layer, keys in layers.items():
                held[layer] = held.get(layer, 0) + keys.shape[0]
        return held
