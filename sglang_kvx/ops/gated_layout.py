"""Shapes shared by ``ops/gated_attention.py``'s reference and its Triton kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class FoldedKeys:
    """Rows whose older entries were re-folded out of their cells: row b does not read its row
    indices [hidden_from[b], hidden_to[b]); instead it reads the extra keys
    ``keys[indptr[b]:indptr[b + 1]]`` (with their values and gates), which precede all its queries."""

    hidden_from: torch.Tensor  # [B]
    hidden_to: torch.Tensor  # [B]
    keys: torch.Tensor  # [E, Hkv, D]
    values: torch.Tensor  # [E, Hkv, Dv]
    gates: torch.Tensor | None  # [E] (None in a layer without a gate)
    indptr: torch.Tensor  # [B + 1]
