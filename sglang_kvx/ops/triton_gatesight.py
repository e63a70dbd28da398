"""Triton kernel for ``ops.gatesight.mlp_utility`` (checked against the torch reference, also
under TRITON_INTERPRET=1 on CPU).

One program per (estimator = layer * H + head, block of BLOCK_N entries): load the block's
features [BLOCK_N, F] once, multiply by the estimator's w1 [F, U] in BLOCK_F slices, add b1,
ReLU, dot with w2 [U], add b2, store. Nothing [n, U]-sized ever reaches global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mlp_utility_kernel(
    x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    n, num_features, num_heads,
    stride_xl, stride_xn,
    UNITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    estimator = tl.program_id(0)
    block = tl.program_id(1)
    layer = estimator // num_heads
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    units = tl.arange(0, UNITS)
    hidden = tl.zeros((BLOCK_N, UNITS), dtype=tl.float32)
    for f0 in range(0, num_features, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        x = tl.load(
            x_ptr + layer * stride_xl + rows[:, None] * stride_xn + cols[None, :],
            mask=(rows[:, None] < n) & (cols[None, :] < num_features), other=0.0,
        )
        w = tl.load(
            w1_ptr + estimator * num_features * UNITS + cols[:, None] * UNITS + units[None, :],
            mask=cols[:, None] < num_features, other=0.0,
        )
        hidden += tl.dot(x, w, input_precision="ieee")
    hidden += tl.load(b1_ptr + estimator * UNITS + units)[None, :]
    hidden = tl.maximum(hidden, 0.0)
    w2 = tl.load(w2_ptr + estimator * UNITS + units)
    utility = tl.sum(hidden * w2[None, :], axis=1) + tl.load(b2_ptr + estimator)
    tl.store(out_ptr + estimator * n + rows, utility, mask=rows < n)


def mlp_utility_triton(
    features: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
    block_n: int = 64, block_f: int = 32,
) -> torch.Tensor:
    num_layers, n, num_features = features.shape
    _, num_heads, _, units = w1.shape
    if units & (units - 1) or units < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two hidden width >= 16, got {units}")
    x = features.float().contiguous()
    out = torch.empty(num_layers, num_heads, n, dtype=torch.float32, device=features.device)
    grid = (num_layers * num_heads, triton.cdiv(n, block_n))
    _mlp_utility_kernel[grid](
        x, w1.float().contiguous(), b1.float().contiguous(), w2.float().contiguous(), b2.float().contiguous(), out,
        n, num_features, num_heads, x.stride(0), x.stride(1),
        UNITS=units, BLOCK_N=block_n, BLOCK_F=block_f,
    )
    return out
