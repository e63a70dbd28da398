"""``h2o``: heavy hitters (most accumulated attention) plus the most recent tokens.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (NeurIPS 2023, arXiv:2306.14048). An entry's accumulated attention is the sum, over
every context query, of the softmax weight it gets (ContextSignals.attention_column_sums),
summed here over the query heads sharing its KV head. The budget is split evenly between the
heavy hitters and a window of recent tokens (the paper's 10% + 10% at a 20% cache).

The split lives in the score: given the layer's budget K, the last int(recent_ratio * K)
positions score +inf and the rest score their accumulated attention, so top-K selection keeps
exactly the recent window plus the best of the others. Without a budget (a bare score call)
the score is the accumulated attention alone.

Against kvpress's ObservedAttentionPress (its H2O-like press): kvpress divides each key's summed
attention by the number of queries that see it (n - i, causal), and averages over the group; this
keeps the raw sums the H2O paper ranks by (the group sum is only a constant factor); they favour
early keys, which more queries see. On the same input the scores equal kvpress's once divided.
kvpress's press has no recent window; the half-budget recent window here is the paper's.
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy
from sglang_kvx.signals import CaptureSpec, ContextSignals
from sglang_kvx.signals.column_sums import add_column_sums, sum_over_kv_groups

__all__ = ["H2OPolicy", "add_column_sums"]

@register_policy("h2o")
class H2OPolicy(KVPolicy):
    needs = frozenset({"attention"})

    def __init__(self, *, recent_ratio: float = 0.5) -> None:
        if not 0.0 <= recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio}")
        self.recent_ratio = recent_ratio

    def captures(self) -> CaptureSpec:
        return CaptureSpec(column_sums=True)

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        column_sums = layer_signal(signals, "attention_column_sums", layer, self.name)  # [q_heads or kv_heads, n]
        accumulated = sum_over_kv_groups(column_sums.float(), signals.num_kv_heads)
        if budget is None:
            return accumulated
        num_recent = min(int(self.recent_ratio * budget), signals.n)
        scores = accumulated.clone()
        if num_recent > 0:
            scores[:, signals.n - num_recent :] = float("inf")
        return scores
