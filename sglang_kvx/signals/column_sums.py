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
