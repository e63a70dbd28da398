"""``threshold``: each (layer, KV head) keeps every entry whose score reaches a threshold (KVzap's rule).

Jegou & Jeblick 2026 (KVzap, Algorithm 1): an entry is kept iff its score >= tau, each layer, KV head
and token decided on its own; how much a context keeps is an outcome, not a budget, so
``keep_fraction`` is not read. The policy gives tau as its allocation option (``policies/kvzap.py``:
its window scores +inf, so it is always kept). Rank-consistent under tensor parallelism: no head
reads another's scores.
"""

from __future__ import annotations

import torch

from sglang_kvx.allocate.base import register_allocation
from sglang_kvx.signals import ContextSignals


@register_allocation("threshold", reads_scores=True)
def threshold_budgets(keep_fraction: float, num_budgeted: int, num_layers: int, signals: ContextSignals | None = None,
                      *, scores: list[torch.Tensor], threshold: float | None = None) -> list[list[int]]:
    if threshold is None:
        raise ValueError("allocation 'threshold' needs a policy that gives a threshold (kvzap, kvzap_linear)")
    return [(s.float() >= threshold).sum(dim=-1).tolist() for s in scores]
