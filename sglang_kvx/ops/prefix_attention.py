"""Paged attention over request rows whose compacted prefix a layer reads in its own way.

A row's keys are its pool slots ``req_to_token[row, :seq_len]`` (SGLang's paged layout,
tokens first); in the layer at hand, row indices ``[hidden_from, hidden_to)`` are hidden
(ranks the layer does not keep) and the row's extra entries ``extra_k/extra_v[extra_indptr[b]
: extra_indptr[b + 1]]`` (ranks the layer keeps in another layer's buffer) are visible to every
query of the row. Queries are causal over the row: query t of a row with q_len queries sits at
row index seq_len - q_len + t.

Shapes: q [T, Hq, D] (the rows' queries, in batch order); k_cache [P, Hkv, D]; v_cache
[P, Hkv, Dv]; req_to_token [R, M]; rows, seq_lens, q_lens, hidden_from, hidden_to [B];
extra_k [E, Hkv, D]; extra_v [E, Hkv, Dv]; extra_indptr [B + 1]. Returns [T, Hq, Dv] in q's
dtype. Math in float32; ``k_scale``/``v_scale`` multiply cached keys and values.

``prefix_cells_attention`` dispatches: the Triton kernel on CUDA (and under TRITON_INTERPRET=1
when asked for), else the torch reference, which is the source of truth.
"""

from __future__ import annotations

import os

import torch


def prefix_cells_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    hidden_from: torch.Tensor, hidden_to: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor, extra_indptr: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    num_heads = q.shape[1]
    out = q.new_empty((q.shape[0], num_heads, v_cache.shape[-1]))
    device = q.device
    start = 0
    for b, (row, seq_len, q_len, lo, hi) in enumerate(zip(
            rows.tolist(), seq_lens.tolist(), q_lens.tolist(), hidden_from.tolist(), hidden_to.tolist())):
        # Only the row's columns outside [lo, hi) are read: a windowed decode step reads sinks +
        # window, not its whole history.
        lo, hi = min(max(lo, 0), seq_len), min(max(hi, lo), seq_len)
        columns = torch.cat([torch.arange(lo, device=device), torch.arange(hi, seq_len, device=device)])
        slots = req_to_token[row, columns].to(torch.long)
        e0, e1 = int(extra_indptr[b]), int(extra_indptr[b + 1])
        keys = torch.cat([k_cache[slots], extra_k[e0:e1]])  # [visible + extra, Hkv, D]
        values = torch.cat([v_cache[slots], extra_v[e0:e1]])
        visible = columns[None, :] <= (seq_len - q_len + torch.arange(q_len, device=device))[:, None]
        visible = torch.cat([visible, visible.new_ones((q_len, e1 - e0))], dim=1)
        keys = keys.transpose(0, 1).float() * k_scale  # [Hkv, S, D]
        values = values.transpose(0, 1).float() * v_scale
        group = num_heads // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        query = q[start : start + q_len].transpose(0, 1).float()  # [Hq, T, D]
        logits = (query @ keys.transpose(1, 2) * scaling).masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = (logits.softmax(-1) @ values).transpose(0, 1).to(out.dtype)
        start += q_len
    return out


def prefix_cells_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    hidden_from: torch.Tensor, hidden_to: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor, extra_indptr: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, impl: str = "auto",
) -> torch.Tensor:
    """impl: "auto" (Triton on CUDA, torch elsewhere), "torch", "triton"."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if q.dim() != 3 or k_cache.dim() != 3 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"need q [T, Hq, D] and k_cache [P, Hkv, D] with Hkv dividing Hq; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if int(q_lens.sum()) != q.shape[0] or extra_indptr.numel() != rows.numel() + 1:
        raise ValueError("q_lens must sum to the number of queries and extra_indptr hold one more entry than rows")
    args = (q, k_cache, v_cache, req_to_token, rows, seq_lens, q_lens, hidden_from, hidden_to,
            extra_k, extra_v, extra_indptr, scaling, k_scale, v_scale)
    use_triton = impl == "triton" or (impl == "auto" and q.is_cuda and _triton_available())
    if not use_triton:
        return prefix_cells_attention_reference(*args)
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton prefix-cells attention needs CUDA tensors (or TRITON_INTERPRET=1 to run it on CPU)")
    from sglang_kvx.ops.triton_prefix_attention import prefix_cells_attention_triton

    return prefix_cells_attention_triton(*args)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
