"""Decode attention over sinks + a recent window of SGLang's paged KV (On-Demand Attention's Local step).

A row's keys are its pool slots ``req_to_token[row, :seq_len]`` (tokens first; the current token
is the last one, so ``seq_len`` counts it). A Local row reads the ``sinks`` first keys and the
``window`` most recent ones: row indices ``[0, sink_end)`` and ``[window_start, seq_len)`` with
``window_start = max(seq_len - window, 0)`` and ``sink_end = min(sinks, window_start)`` (the two
ranges never overlap). ``window <= 0`` or ``window >= seq_len`` reads the whole row (Full), so
Local and Full rows share one batch.

Shapes: q [B, Hq, D] (one decode query per row); k_cache [P, Hkv, D]; v_cache [P, Hkv, Dv];
req_to_token [R, M] (int32 slots); rows, seq_lens, sinks, window [B]. Hkv divides Hq (GQA).
Returns [B, Hq, Dv] in q's dtype. Math in float32; ``k_scale``/``v_scale`` multiply cached keys
and values.

``window_attention`` dispatches (``ops/dispatch.py``, op ``window_attention``): FlashInfer on CUDA
when it imports and takes the shapes (``ops/flashinfer_window_attention.py``), else the Triton
kernel on CUDA, else the torch reference, which is the source of truth.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sglang_kvx.ops.dispatch import choose, run
from sglang_kvx.ops.flashinfer_plans import DecodePlans, flashinfer_shapes
from sglang_kvx.ops.window_ranges import window_key_ranges


def window_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    device = q.device
    if batch == 0:
        return q.new_empty((0, num_heads, v_cache.shape[-1]))
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    sink_end, window_start = window_key_ranges(seq_lens, sinks.to(device), window.to(device))
    count = sink_end + seq_lens - window_start  # keys each row reads
    # Gather only the keys a row reads, padded to the longest row: a Local batch touches s + w
    # keys per row however long the rows are.
    j = torch.arange(int(count.max()), device=device)
    columns = torch.where(j < sink_end[:, None], j, window_start[:, None] + j - sink_end[:, None])
    valid = j < count[:, None]  # [B, N]
    columns = torch.where(valid, columns, 0)
    slots = req_to_token[rows.to(device=device, dtype=torch.long)[:, None], columns].to(torch.long)
    keys = k_cache[slots].float() * k_scale  # [B, N, Hkv, D]
    values = v_cache[slots].float() * v_scale  # [B, N, Hkv, Dv]
    kv_heads = keys.shape[2]
    query = q.float().reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    logits = torch.einsum("bhgd,bnhd->bhgn", query, keys) * scaling
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhe->bhge", logits.softmax(-1), values)
    return out.reshape(batch, num_heads, -1).to(q.dtype)


def window_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, impl: str | None = None,
    plans: DecodePlans | None = None, plan_key: Hashable | None = None,
) -> torch.Tensor:
    """impl: see ``ops/dispatch.py`` (auto: FlashInfer, else Triton on CUDA; torch elsewhere).
    FlashInfer only: ``plans`` holds the forward batch's planned wrappers, and calls with one
    ``plan_key`` (the caller's name for the rows' (sinks, window) ranges) share one plan."""
    if q.dim() != 3 or k_cache.dim() != 3 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"need q [B, Hq, D] and k_cache [P, Hkv, D] with Hkv dividing Hq; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if not rows.numel() == seq_lens.numel() == sinks.numel() == window.numel() == q.shape[0]:
        raise ValueError("rows, seq_lens, sinks and window need one entry per query row")
    # Checked where it is free: on a GPU ``.min()`` would cost a host round trip per layer.
    if q.shape[0] and seq_lens.device.type == "cpu" and int(seq_lens.min()) < 1:
        raise ValueError("every row needs seq_len >= 1 (the current token is one of its keys)")
    args = (q, k_cache, v_cache, req_to_token, rows, seq_lens, sinks, window, scaling, k_scale, v_scale)
    chosen = choose("window_attention", impl, q.device,
                    lambda name: flashinfer_shapes(q, k_cache, v_cache) if name == "flashinfer" else None)

    def flashinfer(*args):
        from sglang_kvx.ops.flashinfer_window_attention import window_attention_flashinfer

        return window_attention_flashinfer(*args, plans=plans if plans is not None else DecodePlans(), plan_key=plan_key)

    def triton(*args):
        from sglang_kvx.ops.triton_window_attention import window_attention_triton

        return window_attention_triton(*args)

    return run("window_attention", impl, chosen, window_attention_reference,
               {"flashinfer": flashinfer, "triton": triton}, *args)
