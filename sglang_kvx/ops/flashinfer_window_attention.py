"""FlashInfer path for ``ops.window_attention.window_attention``, used only where flashinfer imports
on CUDA. NOT TESTED on a GPU (the project's machines have none): on CPU a stand-in module with
FlashInfer's signatures checks the index sets, the merge and the plan count
(``tests/test_ops_window_attention.py``). A GPU session should compare it with the reference first.

The window (the whole row for a Full row) is one batch decode, the sinks of the rows that have any
a second one, the two merged with ``flashinfer.merge_state``. FlashInfer's own ``window_left`` is one
value per plan; ODA batches mix windows (and Full rows), so both key ranges go in as explicit slot
lists instead (page size 1, as SGLang's FlashInfer backend lays out the pool). Planned once per
forward batch and key (``ops/flashinfer_plans.py``): layers hiding the same ranges share the plans.
Host syncs (index-set sizes) make it unfit for CUDA graph capture.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sglang_kvx.ops.flashinfer_plans import DecodePlans, slot_ranges, use_tensor_cores
from sglang_kvx.ops.window_ranges import window_key_ranges


def window_attention_flashinfer(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    rows: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
    scaling: float, k_scale: float = 1.0, v_scale: float = 1.0, *, plans: DecodePlans,
    plan_key: Hashable | None = None,
) -> torch.Tensor:
    import flashinfer

    device = q.device
    rows = rows.to(device=device, dtype=torch.long)
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    sink_end, window_start = window_key_ranges(seq_lens, sinks.to(device), window.to(device))
    tensor_cores = use_tensor_cores(q.shape[1], k_cache.shape[1], k_cache)
    paged_kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [P, page_size=1, Hkv, D]
    # The window range is never empty (it holds the current token), so every row gets a valid lse.
    out, lse = plans.run(None if plan_key is None else ("window", plan_key), q, paged_kv,
                         lambda: slot_ranges(req_to_token, rows, window_start, seq_lens),
                         scaling, tensor_cores, k_scale, v_scale)
    with_sinks = torch.nonzero(sink_end > 0).squeeze(1)
    if with_sinks.numel():
        sink_out, sink_lse = plans.run(
            None if plan_key is None else ("sinks", plan_key), q[with_sinks], paged_kv,
            lambda: slot_ranges(req_to_token, rows[with_sinks], torch.zeros_like(with_sinks), sink_end[with_sinks]),
            scaling, tensor_cores, k_scale, v_scale)
        out[with_sinks] = flashinfer.merge_state(out[with_sinks], lse[with_sinks], sink_out, sink_lse)[0]
    return out
