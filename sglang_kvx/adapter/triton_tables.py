"""SGLang's Triton attention backend reading page tables with its own kernels (issue #56 item 2).

A layer's page table (``serve/page_tables.py``) lists, per row, the cells the row reads. SGLang's Triton
kernels read a request's keys through ``kv_indptr`` / ``kv_indices`` (its ragged page table, one token
per page): give them the table's ragged form (``ragged_lists``, built on the device) and they read a
child's kept ranks, its borrowed cells and its tokens, or a decode step's sinks and window, as they
read a plain row. Cells of other layers are rows of the pool's one allocation (``CellSpace``), which
the kernels are handed as the layer's K/V buffer.

A per-head table (each KV head of a row reads its own cells) addresses single heads: cell c's head h
is ``c * heads + h``. Seen as a pool of one KV head per cell (``[cells * heads, 1, D]``, a view), each
(row, KV head) is one row of the same kernels, its KV head's query heads their group (decode:
``[rows * heads, group, D]`` queries, a view; extend: the new tokens' queries, keys and values reordered
(row, KV head)-major once per batch, the table's ``order``).

Decode: ``decode_attention_fwd`` (split-KV), every table row split the same number of times (the
backend's ``max_kv_splits``, as SGLang's static-splits setting does). Extend (a child's question):
``extend_attention_fwd`` with each row's cells before its new tokens as the prefix and the new
tokens' K/V as the extend part, causal. Both are SGLang's own kernels, unchanged.

Where it runs: on CUDA when SGLang builds its Triton backend (``--attention-backend triton``) with
compaction on; unrun there (no GPU here). On CPU the tests run ``table_decode`` and ``table_extend``
with SGLang's kernels under the Triton interpreter against keys gathered by hand. A CUDA graph of this
backend carries no page tables (the page-table variant is installed by the CPU emulation only), so
batches with such rows run eagerly there (``serve/graph_eligibility.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, logit_capping_mod
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_kvx.adapter.attention import ReadsPageTables, per_layer_lengths_class, register_page_table_reader
from sglang_kvx.adapter.forward import link_of
from sglang_kvx.serve.page_tables import LayerTable, one_head_per_cell, ragged_lists


class KvxTritonAttnBackend(per_layer_lengths_class(TritonAttnBackend), ReadsPageTables):
    """SGLang's Triton attention with per-layer lengths, reading each layer's page table with its own kernels."""

    __slots__ = ()

    def forward_page_table(self, q, k, v, layer, forward_batch, save_kv_cache: bool, table: LayerTable,
                           decode: bool) -> torch.Tensor:
        if table.lens_host is None:
            raise NotImplementedError("a captured graph's static page table on the Triton backend: its graphs carry none")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v,
                                                layer.k_scale, layer.v_scale)
        if table.space is not None:  # it reads cells of other layers' buffers too
            k_cache, v_cache = table.space.keys, table.space.values
        else:
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        cap = logit_capping_mod(layer.logit_capping_method, layer.logit_cap)
        batch = link_of(self).batch(forward_batch)
        if decode:  # the table's ragged form: once per batch for every layer sharing the table
            ragged = batch.shared(("triton_ragged", id(table)), lambda: ragged_lists(table.cells, table.lens,
                                                                                     table.lens_host))
            out = table_decode(self.decode_attention_fwd, q, k_cache, v_cache, table, ragged, layer.scaling,
                               self.max_kv_splits, cap)
        else:
            new_host = forward_batch.extend_seq_lens_cpu
            prefix = batch.shared(("triton_prefix", id(table)), lambda: table_prefix(table, new_host))
            out = table_extend(self.extend_attention_fwd, q, k.reshape(q.shape[0], -1, layer.qk_head_dim),
                               v.reshape(q.shape[0], -1, layer.v_head_dim), k_cache, v_cache, table, prefix,
                               new_host, layer.scaling, cap)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


register_page_table_reader(TritonAttnBackend, KvxTritonAttnBackend)


def table_decode(decode_fwd: Callable, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: LayerTable, ragged: tuple[torch.Tensor, torch.Tensor], scaling: float, max_kv_splits: int,
                 logit_cap: float = 0.0) -> torch.Tensor:
    """One decode step's attention of ``q`` ``[rows, Hq, D]`` over ``table`` (``ragged``: its
    ``ragged_lists``) by SGLang's ``decode_attention_fwd``; ``[rows, Hq, Dv]``."""
    rows, q_heads = q.shape[:2]
    keys, values = one_head_per_cell(k_cache, v_cache, table)
    queries = q.reshape(rows * table.heads, q_heads // table.heads, q.shape[-1]) if table.heads else q
    count, group = queries.shape[:2]
    v_dim = values.shape[-1]
    out = queries.new_empty((count, group, v_dim))
    logits = torch.empty((count, group, max_kv_splits, v_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((count, group, max_kv_splits), dtype=torch.float32, device=q.device)
    splits = torch.full((count,), max_kv_splits, dtype=torch.int32, device=q.device)
    indptr, indices = ragged
    decode_fwd(queries, keys, values, out, indptr, indices, logits, lse, splits, max_kv_splits, scaling, 1.0, 1.0,
               logit_cap=logit_cap)
    return out.reshape(rows, q_heads, v_dim)


def table_prefix(table: LayerTable, new_host: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """An extend's inputs from its table, built on the device from host counts: each table row's cells before
    its new tokens as ``(kv_indptr, kv_indices)``, its new tokens' ``qo_indptr``, and the most new tokens of
    a row (``new_host``: the batch rows' new tokens)."""
    per_row = [n for n in new_host for _ in range(max(table.heads, 1))]
    before_host = [count - n for count, n in zip(table.lens_host, per_row)]
    new = table.extend_lens if table.extend_lens is not None else table.lens - table.prefix_lens
    kv_indptr, kv_indices = ragged_lists(table.cells, table.prefix_lens, before_host)
    qo_indptr = torch.zeros(len(per_row) + 1, dtype=torch.int32, device=table.cells.device)
    qo_indptr[1:] = torch.cumsum(new, 0)
    return kv_indptr, kv_indices, qo_indptr, max(per_row, default=0)


def table_extend(extend_fwd: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, table: LayerTable, prefix: tuple, new_host: list[int], scaling: float,
                 logit_cap: float = 0.0) -> torch.Tensor:
    """An extend's attention over ``table`` by SGLang's ``extend_attention_fwd``: the new tokens' ``q``
    ``[tokens, Hq, D]``, ``k`` / ``v`` ``[tokens, Hkv, D]`` (already in the cache too), ``prefix`` from
    ``table_prefix``; ``[tokens, Hq, Dv]`` in the batch's token order."""
    tokens, q_heads = q.shape[:2]
    keys, values = one_head_per_cell(k_cache, v_cache, table)
    kv_indptr, kv_indices, qo_indptr, longest = prefix
    if table.heads:  # (row, KV head)-major: each (row, KV head) one row of the kernel, one KV head
        heads = table.heads
        q = q.reshape(tokens * heads, q_heads // heads, q.shape[-1])[table.order]
        k = k.reshape(tokens * heads, 1, k.shape[-1])[table.order]
        v = v.reshape(tokens * heads, 1, v.shape[-1])[table.order]
    out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
    extend_fwd(q.contiguous(), k.contiguous(), v.contiguous(), out, keys, values, qo_indptr, kv_indptr, kv_indices,
               None, True, None, longest, 1.0, 1.0, sm_scale=scaling, logit_cap=logit_cap,
               extend_seq_lens_cpu=[n for n in new_host for _ in range(max(table.heads, 1))])
    if table.heads:
        out = torch.empty_like(out).index_copy_(0, table.order, out)  # back to the batch's token order
    return out.reshape(tokens, q_heads, -1)
