"""``pyramidkv``: SnapKV's scores with budgets shrinking linearly from the first layer to the last.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069): attention is spread out in low layers and concentrated in high ones, so low
layers get more cache. The last layer gets 1/beta of the mean (beta = 20) and the first the rest
of the arithmetic series, so the model-wide total is the flat one up to rounding; budgets too
small for the pyramid fall back to flat ones (see sglang_kvx.allocate.pyramid).
Scoring is SnapKV's (observation window 64, pooling kernel 5, as the PyramidKV repo's defaults).

Against kvpress's PyramidKVPress: the scores differ only as SnapKV's do (sums for means, the
window at +inf; see sglang_kvx.policies.snapkv). The budgets are kvpress's rule, window inside
each budget and its fallback to flat SnapKV budgets when the last layer would get fewer than w
entries; here m is the context minus the protected prefix and L counts attention layers only
(see sglang_kvx.allocate.pyramid). The policy passes its window_size to the allocation.
"""

from __future__ import annotations

from typing import Any

from sglang_kvx.policies.base import register_policy
from sglang_kvx.policies.snapkv import SnapKVPolicy


@register_policy("pyramidkv")
class PyramidKVPolicy(SnapKVPolicy):
    allocation = "pyramidkv"

    def __init__(self, *, window_size: int = 64, kernel_size: int = 5, pooling: str = "avg", beta: float = 20.0) -> None:
        super().__init__(window_size=window_size, kernel_size=kernel_size, pooling=pooling)
        if beta < 1:
            raise ValueError(f"beta must be >= 1, got {beta}")
        self.beta = beta

    @property
    def allocation_options(self) -> dict[str, Any]:
        return {"beta": self.beta, "window_size": self.window_size}
