"""Triton kernel for ``ops.prefix_attention.prefix_cells_attention`` (checked against the torch
reference, also under TRITON_INTERPRET=1 on CPU).

One program per (query token, query head): walk the token's row in blocks of BLOCK_N slots
(causal bound, hidden range skipped), then the row's extra entries, with an online softmax
in float32; keys and values are read straight from the paged pool through req_to_token.
A token re-reads its row's keys, which suits decode (one query per row) and the short
questions children ask; a long child prompt would want query tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _attend_block(q, k_ptrs, v_ptrs, visible, m, l, acc, d_ok, dv_ok, scale_qk, v_scale):
    k = tl.load(k_ptrs, mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * scale_qk
    s = tl.where(visible, s, -1.0e30)  # finite: exp(m_old - m_new) stays defined before any visible key
    m_new = tl.maximum(m, tl.max(s, axis=0))
    p = tl.where(visible, tl.exp(s - m_new), 0.0)
    alpha = tl.exp(m - m_new)
    v = tl.load(v_ptrs, mask=visible[:, None] & dv_ok[None, :], other=0.0).to(tl.float32) * v_scale
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    l = l * alpha + tl.sum(p, axis=0)
    return m_new, l, acc


@triton.jit
def _prefix_cells_kernel(
    q_ptr, k_ptr, v_ptr, r2t_ptr, out_ptr,
    token_batch_ptr, token_last_ptr, rows_ptr, hidden_from_ptr, hidden_to_ptr,
    ek_ptr, ev_ptr, eptr_ptr, ecount_ptr, kv_heads,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_r2t,
    stride_ekp, stride_ekh, stride_evp, stride_evh, stride_ot, stride_oh,
    group, head_dim, v_head_dim, scale_qk, v_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    b = tl.load(token_batch_ptr + token)
    last = tl.load(token_last_ptr + token)  # the last row index this query sees
    row = tl.load(rows_ptr + b).to(tl.int64)
    lo = tl.load(hidden_from_ptr + b * kv_heads + kv_head)  # [B, Hkv]: per KV head
    hi = tl.load(hidden_to_ptr + b * kv_heads + kv_head)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < head_dim
    dv_ok = dv < v_head_dim
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], -1.0e30, tl.float32)  # running max and normaliser of the online softmax
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        in_row = j <= last
        visible = in_row & ((j < lo) | (j >= hi))
        slot = tl.load(r2t_ptr + row * stride_r2t + j, mask=in_row, other=0).to(tl.int64)
        m, l, acc = _attend_block(
            q, k_ptr + slot[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
            v_ptr + slot[:, None] * stride_vp + kv_head * stride_vh + dv[None, :],
            visible, m, l, acc, d_ok, dv_ok, scale_qk, v_scale)
    e0 = tl.load(eptr_ptr + b)
    e1 = e0 + tl.load(ecount_ptr + b * kv_heads + kv_head)  # this head's first extra entries
    for start in range(e0, e1, BLOCK_N):
        e = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        visible = e < e1
        m, l, acc = _attend_block(
            q, ek_ptr + e[:, None] * stride_ekp + kv_head * stride_ekh + d[None, :],
            ev_ptr + e[:, None] * stride_evp + kv_head * stride_evh + dv[None, :],
            visible, m, l, acc, d_ok, dv_ok, scale_qk, v_scale)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)


def prefix_cells_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    hidden_from: torch.Tensor, hidden_to: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor, extra_indptr: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, extra_counts: torch.Tensor | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the Triton prefix-cells attention needs a contiguous last dimension in q, the caches and req_to_token")
    v_head_dim = v_cache.shape[-1]
    device = q.device
    q_lens = q_lens.to(device=device, dtype=torch.long)
    token_batch = torch.repeat_interleave(torch.arange(rows.numel(), device=device), q_lens)
    # Query t of a row sits at row index seq_len - q_len + t.
    first = torch.cumsum(q_lens, 0) - q_lens
    local = torch.arange(num_tokens, device=device) - first[token_batch]
    token_last = (seq_lens.to(device)[token_batch] - q_lens[token_batch] + local).to(torch.int32)
    out = torch.empty((num_tokens, num_heads, v_head_dim), dtype=q.dtype, device=device)
    if num_tokens == 0:
        return out
    if extra_k.numel() == 0:  # the kernel still takes a pointer
        extra_k = k_cache[:1]
        extra_v = v_cache[:1]
    extra_k, extra_v = extra_k.contiguous(), extra_v.contiguous()
    kv_heads = k_cache.shape[1]
    per_head = lambda t: (t[:, None].expand(-1, kv_heads) if t.dim() == 1 else t).to(device=device, dtype=torch.int32).contiguous()
    if extra_counts is None:
        extra_counts = (extra_indptr[1:] - extra_indptr[:-1]).to(device)
    hidden_from, hidden_to, extra_counts = per_head(hidden_from), per_head(hidden_to), per_head(extra_counts)
    grid = (num_tokens, num_heads)
    _prefix_cells_kernel[grid](
        q, k_cache, v_cache, req_to_token, out,
        token_batch.to(torch.int32), token_last, rows.to(device=device, dtype=torch.int32),
        hidden_from, hidden_to,
        extra_k, extra_v, extra_indptr.to(device=device, dtype=torch.int32), extra_counts, kv_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), extra_k.stride(0), extra_k.stride(1), extra_v.stride(0), extra_v.stride(1),
        out.stride(0), out.stride(1),
        num_heads // k_cache.shape[1], head_dim, v_head_dim, scaling * k_scale, v_scale,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim),
    )
    return out
