"""The key ranges a windowed decode row reads (shared by ``window_attention``'s reference and kernels)."""

from __future__ import annotations

import torch


def window_key_ranges(seq_lens: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (sink_end, window_start): the row reads indices [0, sink_end) and [window_start, seq_len)."""
    seq_lens = seq_lens.to(torch.long)
    window = window.to(device=seq_lens.device, dtype=torch.long)
    full = (window <= 0) | (window >= seq_lens)
    window_start = torch.where(full, torch.zeros_like(seq_lens), seq_lens - window)
    sink_end = torch.minimum(sinks.to(device=seq_lens.device, dtype=torch.long).clamp(min=0), window_start)
    return sink_end, window_start
