"""H2O's signal: per head and key, the causal softmax attention the context's queries paid it,
accumulated over prefill chunks (``ContextSignals.attention_column_sums``)."""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import QueryChunk, ReferenceLayer, Signal, register_signal


def sum_over_kv_groups(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[q_heads, ...] -> [kv_heads, ...]: sum the query heads sharing each KV head (query head h reads KV head h // group)."""
    num_q_heads = per_query_head.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV groups")
    group_size = num_q_heads // num_kv_heads
    return per_query_head.reshape(num_kv_heads, group_size, *per_query_head.shape[1:]).sum(dim=1)


QUERY_BLOCK = 512  # queries per block
KEY_TILE = 4096  # keys per tile: a block's logits are [q_heads, QUERY_BLOCK, KEY_TILE] at most, whatever S


def add_column_sums(sums: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, scaling: float, first_position: int) -> None:
    """Add, per query head and key, the causal softmax attention of ``queries`` to ``sums`` [q_heads, >= S]
    (or [kv_heads, >= S]: summed over each KV group's query heads, all H2O reads, a group's size smaller).

    queries [t, q_heads, D] sit at positions first_position .. first_position + t - 1 (one prefill
    chunk); keys [S, kv_heads, D] are every key up to the last of them, post-RoPE as cached.
    Accumulated chunk by chunk, this is ContextSignals.attention_column_sums.

    Tiled over keys as well as queries, so that no transient grows with S (a [q_heads, 512, S] float32
    block was 8.6 GB per layer at 128K on 32 heads): a first pass over the key tiles finds each
    query's softmax maximum and denominator, a second adds each tile's normalised weights to its
    keys' sums. Keys are read per KV group, never repeated per query head.
    """
    num_q_heads = queries.shape[1]
    seq_len, num_kv_heads, head_dim = keys.shape
    if sums.shape[0] not in (num_q_heads, num_kv_heads):
        raise ValueError(f"sums for {sums.shape[0]} heads: expected {num_q_heads} query or {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    for start in range(0, queries.shape[0], QUERY_BLOCK):
        block = queries[start : start + QUERY_BLOCK].float().view(-1, num_kv_heads, group, head_dim)
        query_positions = first_position + start + torch.arange(block.shape[0], device=keys.device)
        visible_end = min(seq_len, int(first_position + start + block.shape[0]))  # later keys: no query sees them
        tiles = [(k0, min(k0 + KEY_TILE, visible_end)) for k0 in range(0, visible_end, KEY_TILE)]

        def logits(k0: int, k1: int) -> torch.Tensor:  # [kv_heads, group, t, k1 - k0], the future at -inf
            scores = torch.einsum("tkgd,skd->kgts", block, keys[k0:k1].float()) * scaling
            future = torch.arange(k0, k1, device=keys.device)[None, :] > query_positions[:, None]
            return scores.masked_fill_(future, float("-inf"))

        peak = torch.full(block.shape[1:3] + block.shape[:1], float("-inf"), device=keys.device)  # [kv, g, t]
        total = torch.zeros_like(peak)
        for k0, k1 in tiles:
            tile = logits(k0, k1)
            new_peak = torch.maximum(peak, tile.amax(dim=-1))
            total = total * (peak - new_peak).exp() + (tile - new_peak[..., None]).exp().sum(dim=-1)
            peak = new_peak
        for k0, k1 in tiles:
            weights = (logits(k0, k1) - peak[..., None]).exp_().div_(total[..., None]).sum(dim=2)  # [kv, g, tile]
            sums[:, k0:k1] += weights.reshape(num_q_heads, k1 - k0) if sums.shape[0] == num_q_heads else weights.sum(dim=1)


class ColumnSumsState:
    def __init__(self, n: int, num_layers: int) -> None:
        self.n = n
        self.sums: list[torch.Tensor | None] = [None] * num_layers  # [kv_heads, n]


@register_signal
class ColumnSums(Signal):
    name = "column_sums"
    field = "attention_column_sums"
    reads_queries = True

    def start(self, n: int, num_layers: int, option: int, setup) -> ColumnSumsState:
        return ColumnSumsState(n, num_layers)

    def on_queries(self, state: ColumnSumsState, chunk: QueryChunk) -> None:
        keys = chunk.keys
        if state.sums[chunk.layer] is None:  # per KV head: a group's size less to hold
            state.sums[chunk.layer] = torch.zeros(keys.shape[1], state.n, device=chunk.queries.device)
        add_column_sums(state.sums[chunk.layer], chunk.queries, keys, chunk.scaling, chunk.positions.start)

    def fill(self, state: ColumnSumsState, signals) -> None:
        signals.put(self.field, list(state.sums))

    def reference(self, layer: ReferenceLayer, option: int) -> torch.Tensor:
        """Per query head [q_heads, n]: the whole causal softmax matrix, summed over its rows, one block
        of queries at a time (written apart from ``add_column_sums``: it checks that one)."""
        queries = layer.queries
        keys = layer.keys.repeat_interleave(queries.shape[0] // layer.keys.shape[0], dim=0)
        n = queries.shape[1]
        sums = torch.zeros(queries.shape[0], n, device=queries.device)
        for start in range(0, n, 256):
            end = min(start + 256, n)
            logits = queries[:, start:end] @ keys.transpose(1, 2) * layer.scaling
            mask = torch.ones(end - start, n, dtype=torch.bool, device=queries.device).triu(start + 1)
            sums += logits.masked_fill(mask, float("-inf")).softmax(dim=-1).sum(dim=1)
        return sums
