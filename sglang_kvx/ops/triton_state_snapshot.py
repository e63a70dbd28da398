"""Triton kernel for ``ops.state_snapshot`` (checked against the torch reference, also under
TRITON_INTERPRET=1 on CPU).

A flat copy of whole slot rows between a state viewed as [outer, S, inner] and its snapshot
[outer, n, inner], both as raw integers: program (o * n + r, tile) moves ``inner`` elements of
slot ``slots[r]`` (gather) or back into it (scatter), BLOCK elements per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, slots_ptr, n, inner, src_so, src_sr, dst_so, dst_sr,
                      SCATTER: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    o = pid // n
    r = pid % n
    slot = tl.load(slots_ptr + r)
    if SCATTER:
        src_row = r
        dst_row = slot
    else:
        src_row = slot
        dst_row = r
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < inner
    x = tl.load(src_ptr + o * src_so + src_row * src_sr + i, mask=ok)
    tl.store(dst_ptr + o * dst_so + dst_row * dst_sr + i, x, mask=ok)


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, scatter: bool,
                     block: int = 1024) -> None:
    """src/dst: [outer, rows, inner] integer views with a contiguous inner dim; slots: int64 [n]."""
    outer, _, inner = src.shape
    n = slots.numel()
    if outer * n * inner == 0:
        return
    grid = (outer * n, triton.cdiv(inner, block))
    _copy_rows_kernel[grid](src, dst, slots, n, inner, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
                            SCATTER=scatter, BLOCK=block)
