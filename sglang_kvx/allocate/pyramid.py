"""``pyramidkv``: budgets falling linearly from the first attention layer to the last.

Cai et al., PyramidKV (arXiv:2406.02069), budgets as kvpress's PyramidKVPress (NVIDIA/kvpress)
computes them. With m entries per layer, mean budget a = p * m, observation window w (64) and
beta (20): the last layer gets a / beta and the first 2a - a / beta, linear in between, so the
real budgets sum to L * a. Two clamps:
  - cap: when the first layer would get m - w or more, it gets m - w and the last 2a - (m - w);
  - fallback: unless m >= first >= last >= w (the last layer must still hold the observation
    window), every layer gets the flat SnapKV budget round(a).
Each layer's budget is then rounded on its own with Python's round() (halves to even), the
fallback's too, as kvpress does. The window sits INSIDE each budget: SnapKV's scores rank the
window first, so a layer budget of b keeps the w window entries and b - w others.

Consequences, checked in tests/test_pyramid_budgets.py:
  - the last layer must get at least w: with beta 20 and w 64 that takes a >= 1280 entries per
    layer or p >= 1/2 (with m >= 2w); otherwise (p = 0.2 below 6,400 entries, p = 0.1 below 12,800,
    p = 0.02 below 64,000) PyramidKV keeps SnapKV's flat budgets in every layer;
  - the total is L * a up to rounding, not always the flat total L * flat_budget(p, m): layer by
    layer rounding can differ from it by up to L entries (e.g. p = 0.4, m = 4096, 8 layers: 13,107
    against 13,104), and a fallback at a half (a = 102.5) gives 102 where ``flat`` gives 103.
Where this departs from kvpress: kvpress's q_len is the whole context, here m = n minus the
protected prefix; L counts attention layers only (kvpress's num_hidden_layers counts every
layer); one attention layer gets round(a) (kvpress would divide by L - 1 = 0).
The PyramidKV repo (Zefan-Cai/PyramidKV, pyramidkv_utils.py) differs from kvpress: its budget
excludes the window (each layer keeps its budget plus the w window entries, so the model-wide
total is L * (a + w)), it uses integer division for a / beta and the step, and it has no
fallback for a last layer smaller than w; it falls back to SnapKV only when n < 2a.
Under another policy's scores (``gatesight@pyramidkv``) the rule uses w = 64.
"""

from __future__ import annotations

from sglang_kvx.allocate.base import register_allocation
from sglang_kvx.signals import ContextSignals


@register_allocation("pyramidkv")
def pyramidkv(
    keep_fraction: float,
    num_budgeted: int,
    num_layers: int,
    signals: ContextSignals | None = None,
    *,
    beta: float = 20.0,
    window_size: int = 64,
) -> list[int]:
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    if window_size < 0:
        raise ValueError(f"window_size must be >= 0, got {window_size}")
    m, w = num_budgeted, window_size
    mean = keep_fraction * m
    flat = [round(mean)] * num_layers
    if num_layers == 1:
        return flat
    last = mean / beta
    first = 2 * mean - last
    if first >= m - w:
        first = m - w
        last = 2 * mean - first
    if not m >= first >= last >= w:
        return flat
    step = (first - last) / (num_layers - 1)
    return [round(first - layer * step) for layer in range(num_layers)]
