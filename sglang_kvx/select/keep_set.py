"""Selection: per layer and KV head, the protected prefix plus the top-scoring entries under the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvx.allocate import fill_pages, layer_budgets
from sglang_kvx.ops.compaction import topk_per_head
from sglang_kvx.policies.base import KVPolicy
from sglang_kvx.signals import ContextSignals


@dataclass
class KeepSet:
    """What a compacted context keeps.

    positions[l]: LongTensor [kv_heads, K_l] of kept positions in attention layer l, ascending per
    head; K_l = protected_prefix_len + budget_l, and every head keeps positions [0, protected_prefix_len).
    Heads of one layer keep the same number of entries but not necessarily the same positions.
    """

    positions: list[torch.Tensor]
    n: int
    protected_prefix_len: int

    @property
    def num_layers(self) -> int:
        return len(self.positions)

    @property
    def kept_per_layer(self) -> list[int]:
        return [p.shape[1] for p in self.positions]

    def mask(self, layer: int) -> torch.Tensor:
        """BoolTensor [kv_heads, n]: True where layer ``layer`` keeps the entry."""
        keep = self.positions[layer]
        mask = torch.zeros(keep.shape[0], self.n, dtype=torch.bool, device=keep.device)
        return mask.scatter_(1, keep, True)


def select_keep_set(scores: list[torch.Tensor], budgets: list[int], protected_prefix_len: int) -> KeepSet:
    """Per layer l: each KV head keeps [0, protected_prefix_len) plus its budgets[l] best-scoring other entries.

    scores[l]: float [kv_heads, n]. A budget above the n - protected_prefix_len entries left is
    clamped (everything is kept).
    """
    if len(scores) != len(budgets):
        raise ValueError(f"{len(scores)} layers of scores but {len(budgets)} budgets")
    if not scores:
        raise ValueError("no attention layers to select from")
    n = scores[0].shape[-1]
    if protected_prefix_len < 0:
        raise ValueError(f"protected_prefix_len must be >= 0, got {protected_prefix_len}")
    if protected_prefix_len > n:
        raise ValueError(f"protected prefix of {protected_prefix_len} tokens is longer than the context ({n} tokens)")
    positions = []
    for layer, (layer_scores, budget) in enumerate(zip(scores, budgets)):
        if layer_scores.dim() != 2 or layer_scores.shape[1] != n:
            raise ValueError(f"layer {layer}: scores must be [kv_heads, {n}], got {tuple(layer_scores.shape)}")
        if budget < 0:
            raise ValueError(f"layer {layer}: budget must be >= 0, got {budget}")
        positions.append(topk_per_head(layer_scores, budget, protected_prefix_len))
    return KeepSet(positions=positions, n=n, protected_prefix_len=protected_prefix_len)


def choose_keep_set(
    policy: KVPolicy, signals: ContextSignals, keep_fraction: float, allocation: str | None = None,
    *, page_size: int = 1, fold: bool = True,
) -> KeepSet:
    """The whole score -> allocate -> select step for one prefilled context.

    ``allocation`` overrides the policy's own (e.g. "gate" under SnapKV scores); the policy's
    allocation options (PyramidKV's beta) go only to its own allocation. With ``page_size`` > 1
    the budgets are raised to fill the context's last page (``allocate.fill_pages``; ``fold`` says
    how the context's slots are counted).
    """
    protected = signals.protected_prefix_len
    if not 0 <= protected <= signals.n:
        raise ValueError(f"protected prefix of {protected} tokens does not fit the context ({signals.n} tokens)")
    name = allocation or policy.allocation
    options = policy.allocation_options if name == policy.allocation else {}
    budgets = layer_budgets(name, keep_fraction, signals.n - protected, signals.num_layers, signals, **options)
    budgets = fill_pages(budgets, signals.n - protected, protected, page_size, fold)
    scores = policy.score_layers(signals, budgets)
    for layer, layer_scores in enumerate(scores):
        expected = (signals.num_kv_heads, signals.n)
        if tuple(layer_scores.shape) != expected:
            raise ValueError(f"policy {policy.name!r} scored layer {layer} as {tuple(layer_scores.shape)}, expected {expected}")
    return select_keep_set(scores, budgets, protected)
