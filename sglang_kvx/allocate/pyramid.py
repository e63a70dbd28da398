"""``pyramidkv``: budgets falling linearly from the first attention layer to the last.

Cai et al., PyramidKV (arXiv:2406.02069), budget rule of their repo: with mean budget a, the
last layer gets a / beta (beta = 20) and the first 2a - a / beta, so the arithmetic series
keeps the flat total. When the first layer would need more than the m entries it has, it gets
m and the last 2a - m: still linear, still the same total (kvpress clamps the same way).
"""

from __future__ import annotations

from sglang_kvx.allocate.base import flat_budget, register_allocation, round_to_total
from sglang_kvx.signals import ContextSignals


@register_allocation("pyramidkv")
def pyramidkv(
    keep_fraction: float,
    num_budgeted: int,
    num_layers: int,
    signals: ContextSignals | None = None,
    *,
    beta: float = 20.0,
) -> list[int]:
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    per_layer = flat_budget(keep_fraction, num_budgeted)
    total = per_layer * num_layers
    if num_layers == 1:
        return [per_layer]
    mean = float(per_layer)
    last = mean / beta
    first = 2 * mean - last
    if first > num_budgeted:
        first, last = float(num_budgeted), 2 * mean - num_budgeted
    step = (first - last) / (num_layers - 1)
    return round_to_total([first - layer * step for layer in range(num_layers)], total, num_budgeted)
