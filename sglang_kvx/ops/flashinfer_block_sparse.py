"""FlashInfer path for ``ops.block_sparse.block_sparse_attention``, used only where flashinfer
imports on CUDA. NOT TESTED on a GPU (the project's machines have none): on CPU a stand-in module
whose calls are bound to the installed FlashInfer's signatures checks the index sets and the result
(``tests/test_ops_block_sparse.py``). A GPU session should compare it with the reference first.

SGLang's pool is FlashInfer's paged layout with page size 1, so any set of cells is an explicit
page list. Each query attends to its own chosen blocks, per KV head: one batch decode per KV head,
each query an entry of it with its head's query group as the query heads and that head's column of
the pool as a one-head paged cache (a strided view, no copy). Borrowed cells outside the pool are
not addressable this way: those batches take the Triton kernel.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.block_sparse import BLOCK
from sglang_kvx.ops.window_attention import _flashinfer_decode, _flashinfer_wrapper  # the shared FlashInfer plumbing


def block_sparse_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      block_slots: torch.Tensor, block_positions: torch.Tensor,
                                      selected: torch.Tensor, q_positions: torch.Tensor, scaling: float) -> torch.Tensor:
    num_q, num_heads, _ = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    ids = selected.clamp(min=0)
    slots = block_slots[ids].flatten(2)  # [N, Hkv, K * 4]
    positions = block_positions[ids].flatten(2)
    visible = (selected >= 0).repeat_interleave(BLOCK, dim=-1) & (slots >= 0) & (positions <= q_positions[:, None, None])
    wrapper = _flashinfer_wrapper(q.device, group > 4 or k_cache.element_size() == 1)
    out = torch.empty_like(q)
    for head in range(kv_heads):
        mask = visible[:, head]
        indptr = torch.zeros(num_q + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = mask.sum(1).cumsum(0)
        indices = slots[:, head][mask].to(torch.int32)  # row-major: each query's cells together
        paged_kv = (k_cache[:, head : head + 1].unsqueeze(1), v_cache[:, head : head + 1].unsqueeze(1))  # [P, 1, 1, D]
        queries = q[:, head * group : (head + 1) * group].contiguous()
        out[:, head * group : (head + 1) * group], _ = _flashinfer_decode(wrapper, queries, paged_kv, indptr, indices,
                                                                          scaling, 1.0, 1.0)
    return out
