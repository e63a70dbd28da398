"""Triton kernels for ``ops.block_sparse`` (checked against the torch references, also under
TRITON_INTERPRET=1 on CPU).

- ``compress``: one program per (block, KV head): the mean of the block's up-to-4 keys.
- ``scores``: one program per (query, KV head): the group's summed query against the compressed
  keys of the query's visible blocks, in tiles of BLOCK_W; the top-block pick stays in torch
  (``torch.topk`` over a [N, Hkv, W] score tensor).
- ``attention``: one program per (query, query head): an online softmax in float32 over the
  selected blocks' entries, one four-entry block at a time, read straight from the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_kvx.ops.block_layout import BLOCK
from sglang_kvx.ops.triton_prefix_attention import _attend_block


@triton.jit
def _entry_ptrs(cache_ptr, extra_ptr, slot, pool_size, stride_p, stride_h, stride_ep, stride_eh, head, d):
    """Pointers to each entry's row of ``head``: the pool's cells, or (slot >= pool_size) the extra cells."""
    slot = slot.to(tl.int64)
    in_pool = slot < pool_size
    pool_ptrs = cache_ptr + tl.where(in_pool, slot, 0)[:, None] * stride_p + head * stride_h + d[None, :]
    extra_ptrs = extra_ptr + tl.where(in_pool, 0, slot - pool_size)[:, None] * stride_ep + head * stride_eh + d[None, :]
    return tl.where(in_pool[:, None], pool_ptrs, extra_ptrs)


@triton.jit
def _compress_kernel(k_ptr, ek_ptr, slots_ptr, out_ptr, stride_kp, stride_kh, stride_ekp, stride_ekh,
                     stride_ob, stride_oh, head_dim, pool_size, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.arange(0, BLOCK_E)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + block * BLOCK_E + e)
    valid = slot >= 0
    k = tl.load(_entry_ptrs(k_ptr, ek_ptr, tl.where(valid, slot, 0), pool_size, stride_kp, stride_kh,
                            stride_ekp, stride_ekh, head, d),
                mask=valid[:, None] & (d[None, :] < head_dim), other=0.0).to(tl.float32)
    count = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
    tl.store(out_ptr + block * stride_ob + head * stride_oh + d, tl.sum(k, axis=0) / count, mask=d < head_dim)


def _extra(cache: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The extra cells (contiguous, the cache's dtype), or the cache itself when there are none (never read)."""
    return cache if extra is None or extra.numel() == 0 else extra.to(cache.dtype).contiguous()


def compress_blocks_triton(k_cache: torch.Tensor, block_slots: torch.Tensor,
                           extra_keys: torch.Tensor | None = None) -> torch.Tensor:
    num_blocks, kv_heads, head_dim = block_slots.shape[0], k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(2) != 1:
        raise ValueError("the Triton block compression needs a contiguous last dimension in the key cache")
    out = torch.empty((num_blocks, kv_heads, head_dim), dtype=torch.float32, device=k_cache.device)
    extra = _extra(k_cache, extra_keys)
    if num_blocks:
        _compress_kernel[(num_blocks, kv_heads)](
            k_cache, extra, block_slots.contiguous().to(torch.int64), out, k_cache.stride(0), k_cache.stride(1),
            extra.stride(0), extra.stride(1), out.stride(0), out.stride(1), head_dim, k_cache.shape[0],
            BLOCK_E=BLOCK, BLOCK_D=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _scores_kernel(q_ptr, c_ptr, from_ptr, to_ptr, out_ptr, stride_qn, stride_qh, stride_cb, stride_ch,
                   stride_on, stride_oh, group, head_dim, width, scaling,
                   BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    d_ok = d < head_dim
    q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + (kv_head * group + g)[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < group) & d_ok[None, :], other=0.0).to(tl.float32)
    q = tl.sum(q, axis=0)  # the group's summed query
    lo = tl.load(from_ptr + n)
    hi = tl.load(to_ptr + n)
    for start in range(0, width, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        visible = (lo + w) < hi
        c = tl.load(c_ptr + (lo + w).to(tl.int64)[:, None] * stride_cb + kv_head * stride_ch + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0)
        s = tl.sum(c * q[None, :], axis=1) * scaling
        s = tl.where(visible, s, float("-inf"))
        # 64-bit offsets: n * stride_on passes 2**31 for a chunk of 8K queries over 128K keys
        tl.store(out_ptr + n.to(tl.int64) * stride_on + kv_head * stride_oh + w, s, mask=w < width)


def block_scores_triton(q: torch.Tensor, block_keys: torch.Tensor, block_from: torch.Tensor,
                        block_to: torch.Tensor, scaling: float,
                        spans: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    num_q, num_heads, head_dim = q.shape
    kv_heads = block_keys.shape[1]
    if q.stride(2) != 1:
        raise ValueError("the Triton block indexer needs a contiguous last dimension in q")
    # The widest span: known on the host where the caller planned the batch (``spans``), else read back once.
    width = max(spans[1], default=0) if spans is not None else int((block_to - block_from).max()) if num_q else 0
    out = torch.empty((num_q, kv_heads, width), dtype=torch.float32, device=q.device)
    if num_q and width:
        keys = block_keys.float().contiguous()
        group = num_heads // kv_heads
        _scores_kernel[(num_q, kv_heads)](
            q, keys, block_from.to(torch.int64).contiguous(), block_to.to(torch.int64).contiguous(), out,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
            group, head_dim, width, scaling, BLOCK_G=triton.next_power_of_2(group), BLOCK_W=32,
            BLOCK_D=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _sparse_attention_kernel(q_ptr, k_ptr, v_ptr, ek_ptr, ev_ptr, slots_ptr, pos_ptr, sel_ptr, qpos_ptr, out_ptr,
                             stride_qn, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh,
                             stride_ekp, stride_ekh, stride_evp, stride_evh,
                             stride_sn, stride_sh, stride_on, stride_oh, group, head_dim, v_head_dim, num_selected,
                             pool_size, scale_qk, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    n = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    e = tl.arange(0, BLOCK_E)
    d_ok = d < head_dim
    dv_ok = dv < v_head_dim
    q = tl.load(q_ptr + n * stride_qn + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    q_pos = tl.load(qpos_ptr + n)
    m = tl.full([1], -1.0e30, tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for i in range(0, num_selected):
        block = tl.load(sel_ptr + n * stride_sn + kv_head * stride_sh + i)
        slot = tl.load(slots_ptr + tl.maximum(block, 0) * BLOCK_E + e)
        pos = tl.load(pos_ptr + tl.maximum(block, 0) * BLOCK_E + e)
        visible = (block >= 0) & (slot >= 0) & (pos <= q_pos)
        slot = tl.where(visible, slot, 0)
        m, l, acc = _attend_block(
            q, _entry_ptrs(k_ptr, ek_ptr, slot, pool_size, stride_kp, stride_kh, stride_ekp, stride_ekh, kv_head, d),
            _entry_ptrs(v_ptr, ev_ptr, slot, pool_size, stride_vp, stride_vh, stride_evp, stride_evh, kv_head, dv),
            visible, m, l, acc, d_ok, dv_ok, scale_qk, 1.0)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + n * stride_on + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)


def block_sparse_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_slots: torch.Tensor, block_positions: torch.Tensor, selected: torch.Tensor,
                                  q_positions: torch.Tensor, scaling: float, extra_keys: torch.Tensor | None = None,
                                  extra_values: torch.Tensor | None = None) -> torch.Tensor:
    num_q, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the Triton block-sparse attention needs a contiguous last dimension in q and the caches")
    v_head_dim = v_cache.shape[-1]
    out = torch.empty((num_q, num_heads, v_head_dim), dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    selected = selected.to(torch.int64).contiguous()
    ek, ev = _extra(k_cache, extra_keys), _extra(v_cache, extra_values)
    _sparse_attention_kernel[(num_q, num_heads)](
        q, k_cache, v_cache, ek, ev, block_slots.to(torch.int64).contiguous(), block_positions.to(torch.int64).contiguous(),
        selected, q_positions.to(torch.int64).contiguous(), out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ek.stride(0), ek.stride(1), ev.stride(0), ev.stride(1),
        selected.stride(0), selected.stride(1), out.stride(0), out.stride(1),
        num_heads // k_cache.shape[1], head_dim, v_head_dim, selected.shape[2], k_cache.shape[0], scaling,
        BLOCK_E=BLOCK, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim))
    return out
