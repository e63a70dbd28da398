"""Triton kernel for ``ops.gated_attention.gated_attention`` (checked against the torch reference,
also under TRITON_INTERPRET=1 on CPU).

One program per (query token, query head) walks the token's row causally in blocks of BLOCK_N
slots read through req_to_token. Sigmoid attention needs no running maximum: each key adds
sigmoid(z + b(i)) g_j v_j to the sum. Softmax runs the usual online softmax over z + log(g + eps).
Keys whose gate is below the row's tau are skipped (the query's own key is always read). A row whose
older entries were re-folded skips that row interval and reads them as extra cells instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_kvx.ops.gated_layout import KINDS, FoldedKeys


@triton.jit
def _accumulate(q, k, v, g, visible, own, tau, bias, m, l, acc, scaling, gate_eps,
                SIGMOID: tl.constexpr, HAS_GATE: tl.constexpr):
    """One block of keys into the running sums (sigmoid: a plain sum; softmax: online)."""
    z = tl.sum(k * q[None, :], axis=1) * scaling
    if HAS_GATE:
        z = z + tl.log(g + gate_eps)
        v = v * g[:, None]
        visible = visible & ((g >= tau) | own)
    if SIGMOID:
        p = tl.where(visible, tl.sigmoid(z + bias), 0.0)
        acc = acc + tl.sum(p[:, None] * v, axis=0)
    else:
        z = tl.where(visible, z, -1.0e30)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        p = tl.where(visible, tl.exp(z - m_new), 0.0)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def _gated_attention_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, r2t_ptr, out_ptr, token_batch_ptr, token_last_ptr, q_pos_ptr,
    rows_ptr, tau_ptr, hidden_from_ptr, hidden_to_ptr, ek_ptr, ev_ptr, eg_ptr, eptr_ptr,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_r2t, stride_ot, stride_oh,
    stride_ekp, stride_ekh, stride_evp, stride_evh,
    group, head_dim, v_head_dim, scaling, gate_eps,
    SIGMOID: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    b = tl.load(token_batch_ptr + token)
    last = tl.load(token_last_ptr + token)  # this query's own index in the row
    row = tl.load(rows_ptr + b).to(tl.int64)
    tau = tl.load(tau_ptr + b)
    lo = tl.load(hidden_from_ptr + b)  # row indices [lo, hi) are folded away ...
    hi = tl.load(hidden_to_ptr + b)
    e_start = tl.load(eptr_ptr + b)  # ... and read as the extra cells [e_start, e_end)
    e_end = tl.load(eptr_ptr + b + 1)
    bias = -tl.log(tl.load(q_pos_ptr + token).to(tl.float32) + 1.0)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < head_dim
    dv_ok = dv < v_head_dim
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], -1.0e30, tl.float32)  # softmax only: running max and normaliser
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        visible = (j <= last) & ((j < lo) | (j >= hi))
        slot = tl.load(r2t_ptr + row * stride_r2t + j, mask=visible, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + slot[:, None] * stride_vp + kv_head * stride_vh + dv[None, :],
                    mask=visible[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + slot, mask=visible, other=1.0).to(tl.float32)
        else:
            g = tl.zeros([BLOCK_N], tl.float32)
        m, l, acc = _accumulate(q, k, v, g, visible, j == last, tau, bias, m, l, acc, scaling, gate_eps,
                                SIGMOID, HAS_GATE)
    for start in range(e_start, e_end, BLOCK_N):
        e = start + tl.arange(0, BLOCK_N)
        visible = e < e_end
        k = tl.load(ek_ptr + e[:, None] * stride_ekp + kv_head * stride_ekh + d[None, :],
                    mask=visible[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(ev_ptr + e[:, None] * stride_evp + kv_head * stride_evh + dv[None, :],
                    mask=visible[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(eg_ptr + e, mask=visible, other=1.0).to(tl.float32)
        else:
            g = tl.zeros([BLOCK_N], tl.float32)
        m, l, acc = _accumulate(q, k, v, g, visible, e < 0, tau, bias, m, l, acc, scaling, gate_eps,
                                SIGMOID, HAS_GATE)
    if not SIGMOID:
        acc = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dv, acc.to(out_ptr.dtype.element_ty), mask=dv_ok)


def gated_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_gate: torch.Tensor | None,
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    q_positions: torch.Tensor, tau: torch.Tensor, kind: str, scaling: float, gate_eps: float = 1e-8,
    folded: FoldedKeys | None = None, block_n: int = 32,
) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"attention kind must be one of {KINDS}, got {kind!r}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the Triton gated attention needs a contiguous last dimension in q, the caches and req_to_token")
    tokens, num_heads, head_dim = q.shape
    v_head_dim = v_cache.shape[-1]
    device = q.device
    out = torch.empty((tokens, num_heads, v_head_dim), dtype=q.dtype, device=device)
    if tokens == 0:
        return out
    q_lens = q_lens.to(device=device, dtype=torch.long)
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    token_batch = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens)
    first = torch.cumsum(q_lens, 0) - q_lens  # each row's first token in q
    token_last = seq_lens[token_batch] - q_lens[token_batch] + torch.arange(tokens, device=device) - first[token_batch]
    gate = key_gate if key_gate is not None else q.new_empty(1, dtype=torch.float32)
    batch = rows.numel()
    if folded is None:
        zeros = torch.zeros(batch, dtype=torch.int32, device=device)
        folded = FoldedKeys(zeros, zeros, k_cache[:0], v_cache[:0], None, torch.zeros(batch + 1, dtype=torch.int32, device=device))
    extra_gate = folded.gates if folded.gates is not None else gate
    _gated_attention_kernel[(tokens, num_heads)](
        q, k_cache, v_cache, gate, req_to_token, out, token_batch.to(torch.int32), token_last.to(torch.int32),
        q_positions.to(device=device, dtype=torch.int64), rows.to(device=device, dtype=torch.int32),
        tau.to(device=device, dtype=torch.float32),
        folded.hidden_from.to(device=device, dtype=torch.int32), folded.hidden_to.to(device=device, dtype=torch.int32),
        folded.keys, folded.values, extra_gate, folded.indptr.to(device=device, dtype=torch.int32),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        folded.keys.stride(0), folded.keys.stride(1), folded.values.stride(0), folded.values.stride(1),
        num_heads // k_cache.shape[1], head_dim, v_head_dim, scaling, gate_eps,
        SIGMOID=kind == "sigmoid", HAS_GATE=key_gate is not None,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim),
    )
    return out
