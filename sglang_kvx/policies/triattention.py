"""``triattention``: keep the keys the context's own query centre will attend to at future distances.

Mao et al., "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression" (2026,
arXiv:2604.04921; github.com/WeianMao/triattention). Pre-RoPE queries of a head concentrate
around a fixed centre, so the logit a future query at distance D gives key k is predicted, per RoPE
frequency pair f (complex q_f, k_f; angular frequency w_f), by a trigonometric series

    S(k, D) = sum_f |E q_f| |k_f| cos(D w_f + arg(E q_f conj k_f))      (the centre's logit)
            + sum_f (E|q_f| - |E q_f|) |k_f|                            (norm term: the spread)

averaged over the future distances D = (n - i) + d, d in {1, 2, 4, ..., 65536} (the repo's
geometric offsets, mean aggregation), for key position i of an n-token context. The heads sharing
a KV head are combined by max (the repo's per-head pruning). Query-agnostic: the statistics come
from the context's own prefill queries (un-rotated with their positions), not a calibration set.

The trigonometric term equals the mean over d of RoPE(E q, n + d) . k_i with the cached
(post-RoPE) key, which is how it is computed here. Partial rotary (Qwen3.5: only the first
rotary_dim dims rotate): the unrotated dims are frequency-0 terms, each its own component, so they
add E q . k plus their own norm term.

NVIDIA/kvpress has no TriAttention press, so there is no kvpress definition to differ from; the
reference is the authors' repo, and the departure from it is the one stated above (statistics from
the context's own prefill queries instead of a calibration set).
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy
from sglang_kvx.signals import ContextSignals, QueryStatistics
from sglang_kvx.signals.query_statistics import component_norms, combine_query_statistics, query_statistics, rotate

__all__ = ["TriAttentionPolicy", "combine_query_statistics", "future_offsets", "predicted_logits", "query_statistics", "rotate"]


def future_offsets(max_length: int = 65536) -> torch.Tensor:
    """The repo's geometric schedule of future distances beyond the context end: 1, 2, 4, ... <= max_length."""
    if max_length < 1:
        raise ValueError(f"offset max_length must be >= 1, got {max_length}")
    return 2.0 ** torch.arange(max_length.bit_length(), dtype=torch.float64)


def predicted_logits(stats: QueryStatistics, keys: torch.Tensor, offsets: torch.Tensor, *, use_norm_term: bool = True) -> torch.Tensor:
    """Predicted q . k of every query head for every key: [q_heads, n] (no 1/sqrt(d) scale).

    keys [kv_heads, n, head_dim] are the cached post-RoPE keys of positions 0..n-1; the future
    queries sit at positions n + d for d in ``offsets`` and the trigonometric term is averaged over them.
    """
    num_kv_heads, n, head_dim = keys.shape
    num_q_heads = stats.center.shape[0]
    if num_q_heads % num_kv_heads or stats.center.shape[1] != head_dim:
        raise ValueError(f"query statistics {tuple(stats.center.shape)} do not fit keys {tuple(keys.shape)}")
    group = num_q_heads // num_kv_heads
    keys = keys.float()
    inv_freq = stats.inv_freq.to(keys.device)
    center = stats.center.to(keys.device).float()
    # The centre rotated to each future position, averaged: one effective query per head.
    future = n + offsets.to(keys.device, torch.float64)
    effective = rotate(center[:, None, :].expand(-1, future.shape[0], -1), future, inv_freq).mean(dim=1)  # [Hq, D]
    trig = torch.einsum("kgd,knd->kgn", effective.view(num_kv_heads, group, head_dim), keys)
    scores = trig.reshape(num_q_heads, n)
    if use_norm_term:
        half = inv_freq.shape[0]
        spread = stats.magnitude.to(keys.device).float() - component_norms(center, half)  # [Hq, C]
        key_norms = component_norms(keys, half)  # [Hkv, n, C]
        norm_term = torch.einsum("kgc,knc->kgn", spread.view(num_kv_heads, group, -1), key_norms)
        scores = scores + norm_term.reshape(num_q_heads, n)
    return scores


@register_policy("triattention")
class TriAttentionPolicy(KVPolicy):
    needs = frozenset({"keys", "queries"})

    def __init__(self, *, offset_max_length: int = 65536, use_norm_term: bool = True) -> None:
        self.offsets = future_offsets(offset_max_length)
        self.use_norm_term = use_norm_term

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        keys = layer_signal(signals, "keys", layer, self.name)
        stats = layer_signal(signals, "query_statistics", layer, self.name)
        per_query_head = predicted_logits(stats, keys, self.offsets, use_norm_term=self.use_norm_term)
        return per_query_head.view(signals.num_kv_heads, -1, keys.shape[1]).amax(dim=1)
