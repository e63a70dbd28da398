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

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy, sum_over_kv_groups
from sglang_kvx.signals import CaptureSpec, ContextSignals

QUERY_BLOCK = 512  # queries per block: bounded [q_heads, 512, S] logits at a time


def add_column_sums(sums: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, scaling: float, first_position: int) -> None:
    """Add, per query head and key, the causal softmax attention of ``queries`` to ``sums`` [q_heads, >= S]
    (or [kv_heads, >= S]: summed over each KV group's query heads, all H2O reads, a group's size smaller).

    queries [t, q_heads, D] sit at positions first_position .. first_position + t - 1 (one prefill
    chunk); keys [S, kv_heads, D] are every key up to the last of them, post-RoPE as cached.
    Accumulated chunk by chunk, this is ContextSignals.attention_column_sums.
    """
    num_q_heads = queries.shape[1]
    seq_len = keys.shape[0]
    if sums.shape[0] not in (num_q_heads, keys.shape[1]):
        raise ValueError(f"sums for {sums.shape[0]} heads: expected {num_q_heads} query or {keys.shape[1]} KV heads")
    keys = keys.float().repeat_interleave(num_q_heads // keys.shape[1], dim=1)  # [S, q_heads, D]
    key_positions = torch.arange(seq_len, device=keys.device)
    for start in range(0, queries.shape[0], QUERY_BLOCK):
        block = queries[start : start + QUERY_BLOCK].float()
        logits = torch.einsum("thd,shd->hts", block, keys) * scaling
        query_positions = first_position + start + torch.arange(block.shape[0], device=keys.device)
        future = key_positions[None, :] > query_positions[:, None]
        block_sums = logits.masked_fill(future, float("-inf")).softmax(dim=-1).sum(dim=1)  # [q_heads, S]
        sums[:, :seq_len] += sum_over_kv_groups(block_sums, sums.shape[0])


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
