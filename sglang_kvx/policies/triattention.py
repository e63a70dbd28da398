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


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply rotate-half RoPE to the first 2 * len(inv_freq) dims of x [..., m, head_dim] at ``positions`` [m].

    Pair f is (x[f], x[f + r/2]) for r = rotary_dim, turned by positions * inv_freq[f]; the other
    dims pass through. A negative position un-rotates: ``rotate(rotate(x, p, w), -p, w) == x``.
    """
    half = inv_freq.shape[0]
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [m, r/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)


def _component_norms(x: torch.Tensor, rotary_half: int) -> torch.Tensor:
    """[..., head_dim] -> [..., r/2 + head_dim - r]: the norm of each frequency pair, then |x_j| of each unrotated dim."""
    pairs = torch.hypot(x[..., :rotary_half], x[..., rotary_half : 2 * rotary_half])
    return torch.cat([pairs, x[..., 2 * rotary_half :].abs()], dim=-1)


def query_statistics(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> QueryStatistics:
    """TriAttention's statistics from post-RoPE queries [q_heads, m, head_dim] at ``positions`` [m].

    This is what the server calls on the context queries it captures (all of them, or any
    subset; ``combine_query_statistics`` merges chunks). ``inv_freq`` [rotary_dim / 2] are the
    model's RoPE frequencies (its rotary embedding's ``inv_freq``, scaling already applied). A RoPE
    attention factor (YaRN's mscale) stays in the un-rotated queries, as it is in the cached keys.
    """
    inv_freq = inv_freq.to(device=queries.device, dtype=torch.float32)
    if queries.dim() != 3 or queries.shape[1] != positions.shape[0]:
        raise ValueError(f"need queries [q_heads, m, head_dim] and positions [m]; got {tuple(queries.shape)} and {tuple(positions.shape)}")
    if 2 * inv_freq.shape[0] > queries.shape[-1]:
        raise ValueError(f"rotary dim {2 * inv_freq.shape[0]} exceeds head_dim {queries.shape[-1]}")
    unrotated = rotate(queries.float(), -positions.to(queries.device), inv_freq)
    return QueryStatistics(
        center=unrotated.mean(dim=1),
        magnitude=_component_norms(unrotated, inv_freq.shape[0]).mean(dim=1),
        inv_freq=inv_freq,
        count=int(queries.shape[1]),
    )


def combine_query_statistics(parts: list[QueryStatistics]) -> QueryStatistics:
    """The statistics of the union of the parts' queries (count-weighted means), e.g. over prefill chunks."""
    total = sum(part.count for part in parts)
    if total == 0:
        raise ValueError("no queries to combine")
    return QueryStatistics(
        center=sum(part.center * part.count for part in parts) / total,
        magnitude=sum(part.magnitude * part.count for part in parts) / total,
        inv_freq=parts[0].inv_freq,
        count=total,
    )


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
        spread = stats.magnitude.to(keys.device).float() - _component_norms(center, half)  # [Hq, C]
        key_norms = _component_norms(keys, half)  # [Hkv, n, C]
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
