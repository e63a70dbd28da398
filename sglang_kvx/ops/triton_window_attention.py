"""Triton kernel for ``ops.window_attention.window_attention`` (checked against the torch
reference, also under TRITON_INTERPRET=1 on CPU).

One program per (row, query head): an online softmax in float32 over the row's two key ranges,
the sinks [0, sink_end) and the window [window_start, seq_len), in tiles of BLOCK_N slots read
straight from the paged pool through req_to_token. A Local row costs s + w keys whatever its
length; a Full row (window_start = 0, sink_end = 0) walks the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_kvx.ops.triton_prefix_attention import _attend_block
from sglang_kvx.ops.window_ranges import window_key_ranges


@triton.jit
def _attend_range(q, k_ptr, v_ptr, r2t_row_ptr, lo, hi, m, l, acc, d, dv, d_ok, dv_ok,
                  stride_kp, stride_kh, stride_vp, stride_vh, kv_head, scale_qk, v_scale,
                  BLOCK_N: tl.constexpr):
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        visible = j < hi
        slot = tl.load(r2t_row_ptr + j, mask=visible, other=0).to(tl.int64)
        m, l, acc = _attend_block(
            q, k_ptr + slot[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
            v_ptr + slot[:, None] * stride_vp + kv_head * stride_vh + dv[None, :],
            visible, m, l, acc, d_ok, dv_ok, scale_qk, v_scale)
    return m, l, acc


@triton.jit
def _window_attention_kernel(
    q_ptr, k_ptr, v_ptr, r2t_ptr, out_ptr, rows_ptr, seq_lens_ptr, sink_end_ptr, window_start_ptr,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_r2t, stride_ob, stride_oh,
    group, head_dim, v_head_dim, scale_qk, v_scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    sink_end = tl.load(sink_end_ptr + b)
    window_start = tl.load(window_start_ptr + b)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < head_dim
    dv_ok = dv < v_head_dim
    q = tl.load(q_ptr + b * stride_qb + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], -1.0e30, tl.float32)  # running max and normaliser of the online softmax
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    r2t_row = r2t_ptr + row * stride_r2t
    m, l, acc = _attend_range(q, k_ptr, v_ptr, r2t_row, 0, sink_end, m, l, acc, d, dv, d_ok, dv_ok,
                              stride_kp, stride_kh, stride_vp, stride_vh, kv_head, scale_qk, v_scale, BLOCK_N)
    m, l, acc = _attend_range(q, k_ptr, v_ptr, r2t_row, window_start, seq_len, m, l, acc, d, dv, d_ok, dv_ok,
                              stride_kp, stride_kh, stride_vp, stride_vh, kv_head, scale_qk, v_scale, BLOCK_N)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)


def window_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, block_n: int = 32,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the Triton window attention needs a contiguous last dimension in q, the caches and req_to_token")
    v_head_dim = v_cache.shape[-1]
    device = q.device
    out = torch.empty((batch, num_heads, v_head_dim), dtype=q.dtype, device=device)
    if batch == 0:
        return out
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    sink_end, window_start = window_key_ranges(seq_lens, sinks.to(device), window.to(device))
    _window_attention_kernel[(batch, num_heads)](
        q, k_cache, v_cache, req_to_token, out, rows.to(device=device, dtype=torch.int32),
        seq_lens.to(torch.int32), sink_end.to(torch.int32), window_start.to(torch.int32),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        num_heads // k_cache.shape[1], head_dim, v_head_dim, scaling * k_scale, v_scale,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim),
    )
    return out
