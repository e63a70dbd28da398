"""``global``: one score threshold over every attention layer and KV head (KVzip's and kvpress's rule).

KVzip (Kim et al. 2025, Sec. 3.3, "non-uniform head budget") evicts, over the whole model at once,
the entries whose importance scores fall under one threshold, so that a layer or a KV head the
reconstruction reads much keeps much and another little; kvpress's ``KVzipPress`` does the same by
default (``layerwise=False``). Here the threshold keeps exactly the flat total, num_layers * kv_heads
* round(p * m) entries past the protected prefix: the best-scoring ones over every (layer, KV head),
ties to the later position as in selection. Where it differs: kvpress keeps int(p * n) of the whole
context per head on average, the protected prefix included (here the prefix is kept outside the
budget, as in every other allocation).

Under tensor parallelism a rank scores only its own KV heads, so the threshold would differ from
rank to rank: refused there for now.
"""

from __future__ import annotations

import torch

from sglang_kvx.allocate.base import flat_budget, register_allocation
from sglang_kvx.signals import ContextSignals


@register_allocation("global", reads_scores=True,
                     tp_unsafe="one threshold over every KV head needs all heads' scores, and a rank scores only its own")
def global_threshold(keep_fraction: float, num_budgeted: int, num_layers: int, signals: ContextSignals | None = None,
                     *, scores: list[torch.Tensor]) -> list[list[int]]:
    stacked = torch.stack([s.float().cpu() for s in scores])  # [L, H, m]
    num_heads = stacked.shape[1]
    total = num_layers * num_heads * flat_budget(keep_fraction, num_budgeted)
    if total == 0 or num_budgeted == 0:
        return [[0] * num_heads for _ in range(num_layers)]
    # Best first; among equal scores the later position first (a stable sort of the reversed positions).
    flipped = stacked.flip(-1).reshape(-1)
    order = torch.sort(flipped, descending=True, stable=True).indices[:total]
    kept = torch.zeros(flipped.numel(), dtype=torch.long)
    kept[order] = 1
    return kept.view_as(stacked).sum(-1).tolist()
