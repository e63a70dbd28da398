"""FlashInfer path for ``ops.block_sparse.block_sparse_attention``, used only where flashinfer
imports on CUDA. NOT TESTED on a GPU (the project's machines have none): on CPU a stand-in module
whose calls are bound to the installed FlashInfer's signatures checks the index sets, the result
and the plan count (``tests/test_ops_block_sparse.py``). A GPU session should compare it with the
reference first.

Each query attends to its own chosen blocks, per KV head: one batch decode whose entries are the
(query, KV head) pairs, each with its head's query group as the query heads and one KV head, over
the pool seen as one-head pages (page ``slot * Hkv + head`` of the contiguous [P, Hkv, D] buffer: a
view, no copy). One plan per call: the selection differs per layer, so a layer cannot reuse another
layer's plan. Borrowed cells outside the pool are not addressable this way: those batches take the
Triton kernel.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.block_layout import BLOCK
from sglang_kvx.ops.flashinfer_plans import DecodePlans, use_tensor_cores


def block_sparse_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      block_slots: torch.Tensor, block_positions: torch.Tensor,
                                      selected: torch.Tensor, q_positions: torch.Tensor, scaling: float,
                                      plans: DecodePlans) -> torch.Tensor:
    num_q, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    ids = selected.clamp(min=0)
    slots = block_slots[ids].flatten(2)  # [N, Hkv, K * 4]
    positions = block_positions[ids].flatten(2)
    visible = (selected >= 0).repeat_interleave(BLOCK, dim=-1) & (slots >= 0) & (positions <= q_positions[:, None, None])
    heads = torch.arange(kv_heads, device=q.device)[None, :, None]

    def index_sets() -> tuple[torch.Tensor, torch.Tensor]:
        indptr = torch.zeros(num_q * kv_heads + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = visible.sum(-1).flatten().cumsum(0)
        return indptr, (slots * kv_heads + heads)[visible].to(torch.int32)  # (query, head)-major, as indptr

    pages = k_cache.contiguous().view(-1, 1, 1, head_dim), v_cache.contiguous().view(-1, 1, 1, v_cache.shape[-1])
    queries = q.reshape(num_q * kv_heads, group, head_dim)
    out, _ = plans.run(None, queries, pages, index_sets, scaling, use_tensor_cores(num_heads, kv_heads, k_cache))
    return out.view(num_q, num_heads, -1)
