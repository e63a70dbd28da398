"""TriAttention's signal: per attention layer, the centre and magnitudes of the context's own
un-rotated queries, merged over prefill chunks (``ContextSignals.query_statistics``;
``policies/triattention.py`` reads them)."""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import QueryChunk, QueryStatistics, ReferenceLayer, Signal, register_signal


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


def component_norms(x: torch.Tensor, rotary_half: int) -> torch.Tensor:
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
        magnitude=component_norms(unrotated, inv_freq.shape[0]).mean(dim=1),
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


@register_signal
class QueryStatisticsSignal(Signal):
    name = "query_statistics"
    field = "query_statistics"
    provides = "queries"
    reads_queries = True

    def start(self, n: int, num_layers: int, option: int, setup) -> dict[int, list[QueryStatistics]]:
        return {layer: [] for layer in range(num_layers)}  # attention layer -> per-chunk statistics

    def on_queries(self, state: dict[int, list[QueryStatistics]], chunk: QueryChunk) -> None:
        queries = chunk.queries
        positions = torch.arange(chunk.positions.start, chunk.positions.start + queries.shape[0], device=queries.device)
        state[chunk.layer].append(query_statistics(queries.transpose(0, 1), positions, chunk.inv_freq))

    def fill(self, state: dict[int, list[QueryStatistics]], signals) -> None:
        signals.put(self.field, [combine_query_statistics(state[layer]) for layer in range(len(state))])

    def reference(self, layer: ReferenceLayer, option: int) -> QueryStatistics:
        queries = layer.queries
        return query_statistics(queries, torch.arange(queries.shape[1], device=queries.device), layer.inv_freq().to(queries.device))
