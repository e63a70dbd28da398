"""``flat``: every attention layer keeps round(p * m) of its m budgeted entries."""

from __future__ import annotations

from sglang_kvx.allocate.base import flat_budget, register_allocation
from sglang_kvx.signals import ContextSignals


@register_allocation("flat")
def flat(keep_fraction: float, num_budgeted: int, num_layers: int, signals: ContextSignals | None = None) -> list[int]:
    return [flat_budget(keep_fraction, num_budgeted)] * num_layers
