"""Paged attention over request rows whose compacted prefix a layer reads in its own way.

A row's keys are its pool slots ``req_to_token[row, :seq_len]`` (SGLang's paged layout,
tokens first); in the layer at hand, row indices ``[hidden_from, hidden_to)`` are hidden
(ranks the layer does not keep) and the row's extra entries ``extra_k/extra_v[extra_indptr[b]
: extra_indptr[b + 1]]`` (ranks the layer keeps in another layer's buffer) are visible to every
query of the row. Queries are causal over the row: query t of a row with q_len queries sits at
row index seq_len - q_len + t.

Shapes: q [T, Hq, D] (the rows' queries, in batch order); k_cache [P, Hkv, D]; v_cache
[P, Hkv, Dv]; req_to_token [R, M]; rows, seq_lens, q_lens [B]; hidden_from, hidden_to [B], or
[B, Hkv] when the KV heads of a layer keep different counts (per-head budgets); extra_k [E, Hkv, D];
extra_v [E, Hkv, Dv]; extra_indptr [B + 1]; extra_counts (optional) [B, Hkv]: KV head h of row b
reads only the first extra_counts[b, h] of its row's extra entries (default: all of them).
Returns [T, Hq, Dv] in q's dtype. Math in float32; ``k_scale``/``v_scale`` multiply cached keys and values.

``prefix_cells_attention`` dispatches: the Triton kernel on CUDA (and under TRITON_INTERPRET=1
when asked for), else the torch reference, which is the source of truth.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.dispatch import choose, run


def prefix_cells_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    hidden_from: torch.Tensor, hidden_to: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor, extra_indptr: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, extra_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    num_heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // kv_heads
    out = q.new_empty((q.shape[0], num_heads, v_cache.shape[-1]))
    device = q.device
    hidden_from, hidden_to = _per_head(hidden_from, kv_heads).cpu(), _per_head(hidden_to, kv_heads).cpu()
    start = 0
    for b, (row, seq_len, q_len) in enumerate(zip(rows.tolist(), seq_lens.tolist(), q_lens.tolist())):
        # Only the row's columns outside [lo, hi) are read: a windowed decode step reads sinks +
        # window, not its whole history. Per KV head when the heads hide different ranges.
        lo = hidden_from[b].clamp(0, seq_len)
        hi = torch.maximum(hidden_to[b], lo).clamp(max=seq_len)
        columns = torch.arange(seq_len, device=device)
        columns = columns[(columns < int(lo.max())) | (columns >= int(hi.min()))]  # those some head reads
        slots = req_to_token[row, columns].to(torch.long)
        e0, e1 = int(extra_indptr[b]), int(extra_indptr[b + 1])
        keys = torch.cat([k_cache[slots], extra_k[e0:e1]])  # [visible + extra, Hkv, D]
        values = torch.cat([v_cache[slots], extra_v[e0:e1]])
        causal = columns[None, :] <= (seq_len - q_len + torch.arange(q_len, device=device))[:, None]
        in_row = (columns[None, :] < lo.to(device)[:, None]) | (columns[None, :] >= hi.to(device)[:, None])  # [Hkv, C]
        counts = extra_counts[b].to(device) if extra_counts is not None else torch.full((kv_heads,), e1 - e0, device=device)
        in_extra = torch.arange(e1 - e0, device=device)[None, :] < counts[:, None]  # [Hkv, E]
        visible = torch.cat([causal[None] & in_row[:, None, :],
                             in_extra[:, None, :].expand(-1, q_len, -1)], dim=2)  # [Hkv, T, C + E]
        visible = visible.repeat_interleave(group, 0)
        keys = keys.transpose(0, 1).float() * k_scale  # [Hkv, S, D]
        values = values.transpose(0, 1).float() * v_scale
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
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, impl: str | None = None,
    extra_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """impl: see ``ops/dispatch.py`` (op ``prefix_attention``; auto: Triton on CUDA, torch elsewhere)."""
    if q.dim() != 3 or k_cache.dim() != 3 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"need q [T, Hq, D] and k_cache [P, Hkv, D] with Hkv dividing Hq; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if int(q_lens.sum()) != q.shape[0] or extra_indptr.numel() != rows.numel() + 1:
        raise ValueError("q_lens must sum to the number of queries and extra_indptr hold one more entry than rows")
    kv_heads = k_cache.shape[1]
    for name, t in (("hidden_from", hidden_from), ("hidden_to", hidden_to)):
        if tuple(t.shape) not in ((rows.numel(),), (rows.numel(), kv_heads)):
            raise ValueError(f"{name} must be [B] or [B, Hkv] = [{rows.numel()}, {kv_heads}], got {tuple(t.shape)}")
    if extra_counts is not None and tuple(extra_counts.shape) != (rows.numel(), kv_heads):
        raise ValueError(f"extra_counts must be [B, Hkv] = [{rows.numel()}, {kv_heads}], got {tuple(extra_counts.shape)}")
    args = (q, k_cache, v_cache, req_to_token, rows, seq_lens, q_lens, hidden_from, hidden_to,
            extra_k, extra_v, extra_indptr, scaling, k_scale, v_scale, extra_counts)

    def triton(*args):
        from sglang_kvx.ops.triton_prefix_attention import prefix_cells_attention_triton

        return prefix_cells_attention_triton(*args)

    return run("prefix_attention", impl, choose("prefix_attention", impl, q.device), prefix_cells_attention_reference,
               {"triton": triton}, *args)


def _per_head(hidden: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A [B] hidden bound (one range for every head) as [B, Hkv]."""
    return hidden[:, None].expand(-1, kv_heads) if hidden.dim() == 1 else hidden
