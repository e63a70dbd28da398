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

``window_attention`` dispatches: FlashInfer on CUDA when it imports and supports the shapes,
else the Triton kernel on CUDA (and under TRITON_INTERPRET=1 when asked for), else the torch
reference, which is the source of truth.
"""

from __future__ import annotations

import os

import torch

_IMPLS = ("auto", "torch", "triton", "flashinfer")


def window_key_ranges(seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (sink_end, window_start): the row reads indices [0, sink_end) and [window_start, seq_len)."""
    seq_lens = seq_lens.to(torch.long)
    window = window.to(device=seq_lens.device, dtype=torch.long)
    full = (window <= 0) | (window >= seq_lens)
    window_start = torch.where(full, torch.zeros_like(seq_lens), seq_lens - window)
    sink_end = torch.minimum(sinks.to(device=seq_lens.device, dtype=torch.long).clamp(min=0), window_start)
    return sink_end, window_start


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
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, impl: str = "auto",
) -> torch.Tensor:
    """impl: "auto" (FlashInfer, else Triton on CUDA; torch elsewhere), "torch", "triton", "flashinfer"."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if q.dim() != 3 or k_cache.dim() != 3 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"need q [B, Hq, D] and k_cache [P, Hkv, D] with Hkv dividing Hq; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if not rows.numel() == seq_lens.numel() == sinks.numel() == window.numel() == q.shape[0]:
        raise ValueError("rows, seq_lens, sinks and window need one entry per query row")
    if q.shape[0] and int(seq_lens.min()) < 1:
        raise ValueError("every row needs seq_len >= 1 (the current token is one of its keys)")
    args = (q, k_cache, v_cache, req_to_token, rows, seq_lens, sinks, window, scaling, k_scale, v_scale)
    if impl == "flashinfer" or (impl == "auto" and q.is_cuda and flashinfer_supports(q, k_cache, v_cache)):
        if not flashinfer_supports(q, k_cache, v_cache):
            raise RuntimeError("the FlashInfer window attention needs flashinfer, CUDA tensors, fp16/bf16 q, "
                               "a cache of q's dtype or fp8, D == Dv in (64, 128, 256)")
        return window_attention_flashinfer(*args)
    use_triton = impl == "triton" or (impl == "auto" and q.is_cuda and _triton_available())
    if not use_triton:
        return window_attention_reference(*args)
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton window attention needs CUDA tensors (or TRITON_INTERPRET=1 to run it on CPU)")
    from sglang_kvx.ops.triton_window_attention import window_attention_triton

    return window_attention_triton(*args)


def flashinfer_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """FlashInfer's decode kernels: CUDA, half-precision queries, one head size for K and V."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if k_cache.shape[-1] != v_cache.shape[-1] or k_cache.shape[-1] not in (64, 128, 256):
        return False
    if k_cache.dtype != q.dtype and k_cache.element_size() != 1:  # same half type, or an fp8 cache
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # a broken CUDA toolchain raises more than ImportError
        return False
    return True


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# FlashInfer path ------------------------------------------------------------------------------
# Untested on this project's machines (no GPU): written from FlashInfer 0.7's documented API
# (BatchDecodeWithPagedKVCacheWrapper.plan/run, merge_state) and used only where flashinfer
# imports on CUDA. A GPU session should compare it with the reference before relying on it.

_FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace
_flashinfer_wrappers: dict[tuple[torch.device, bool], object] = {}


def _flashinfer_wrapper(device: torch.device, use_tensor_cores: bool):
    key = (device, use_tensor_cores)
    if key not in _flashinfer_wrappers:
        import flashinfer

        workspace = torch.zeros(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _flashinfer_wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="NHD", use_tensor_cores=use_tensor_cores)
    return _flashinfer_wrappers[key]


def _row_slot_ranges(req_to_token: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                     end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices) for the slots of ``req_to_token[rows[b], start[b]:end[b]]``."""
    lengths = end - start
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.long, device=rows.device)
    indptr[1:] = torch.cumsum(lengths, 0)
    total = int(indptr[-1])
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), lengths, output_size=total)
    columns = start[owner] + torch.arange(total, device=rows.device) - indptr[owner]
    return indptr.to(torch.int32), req_to_token[rows[owner], columns].to(torch.int32)


def _flashinfer_decode(wrapper, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor],
                       indptr: torch.Tensor, indices: torch.Tensor, scaling: float, k_scale: float,
                       v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    k_pages = paged_kv[0]
    # Page size 1: a page is one pool slot, so explicit index sets express any per-row key range.
    wrapper.plan(indptr, indices, torch.ones(q.shape[0], dtype=torch.int32, device=q.device),
                 q.shape[1], k_pages.shape[2], k_pages.shape[3], 1,
                 q_data_type=q.dtype, kv_data_type=k_pages.dtype, sm_scale=scaling)
    # Own output buffers: the wrapper is planned again for the sinks before these are merged.
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return wrapper.run(q, paged_kv, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True)


def window_attention_flashinfer(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """The window (the whole row for a Full row) as one batch decode, the sinks of the rows that
    have any as a second one, the two merged with ``flashinfer.merge_state``.

    FlashInfer's own ``window_left`` is one value per plan; ODA batches mix windows (and Full
    rows), so both key ranges go in as explicit slot lists instead (page size 1, as SGLang's
    FlashInfer backend lays out the pool). Host syncs (index-set sizes) make it unfit for CUDA
    graph capture. NOT TESTED on a GPU: the project's machines have none; on CPU a stand-in
    module with FlashInfer's signatures checks the index sets and the merge.
    """
    import flashinfer

    device = q.device
    rows = rows.to(device=device, dtype=torch.long)
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    sink_end, window_start = window_key_ranges(seq_lens, sinks.to(device), window.to(device))
    group = q.shape[1] // k_cache.shape[1]
    # SGLang's rule for its decode wrappers: tensor cores for wide GQA groups and fp8 caches.
    wrapper = _flashinfer_wrapper(device, group > 4 or k_cache.element_size() == 1)
    paged_kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [P, page_size=1, Hkv, D]
    q = q.contiguous()
    # The window range is never empty (it holds the current token), so every row gets a valid lse.
    indptr, indices = _row_slot_ranges(req_to_token, rows, window_start, seq_lens)
    out, lse = _flashinfer_decode(wrapper, q, paged_kv, indptr, indices, scaling, k_scale, v_scale)
    with_sinks = torch.nonzero(sink_end > 0).squeeze(1)
    if with_sinks.numel():
        indptr, indices = _row_slot_ranges(req_to_token, rows[with_sinks], torch.zeros_like(with_sinks),
                                           sink_end[with_sinks])
        sink_out, sink_lse = _flashinfer_decode(wrapper, q[with_sinks], paged_kv, indptr, indices,
                                                scaling, k_scale, v_scale)
        out[with_sinks] = flashinfer.merge_state(out[with_sinks], lse[with_sinks], sink_out, sink_lse)[0]
    return out
