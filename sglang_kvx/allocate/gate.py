"""``gate``: each attention layer's budget proportional to its mean output-gate magnitude.

GateSight (seed 000 in the method digest): on gated-attention hybrids (Qwen3.5 / Qwen3-Next)
a layer whose output gate is mostly shut contributes little, so it gets a smaller share.
Budget_l ∝ mean(|sigmoid(gate)|)^exponent over the context's tokens and query heads, exponent 1,
same model-wide total as flat; a layer capped at its m entries passes its excess to the others.
(Under tensor parallelism the runtime gathers every rank's query heads' gates first, so every rank
computes the same budgets.)
"""

from __future__ import annotations

from sglang_kvx.allocate.base import flat_budget, proportional_with_cap, register_allocation, round_to_total
from sglang_kvx.signals import ContextSignals


@register_allocation("gate", needs=frozenset({"output_gate"}))
def gate(
    keep_fraction: float,
    num_budgeted: int,
    num_layers: int,
    signals: ContextSignals | None = None,
    *,
    exponent: float = 1.0,
    floor: float = 0.0,
) -> list[int]:
    if signals is None or signals.output_gate is None:
        raise ValueError("the gate allocation needs ContextSignals.output_gate (a gated-attention model)")
    if len(signals.output_gate) != num_layers:
        raise ValueError(f"output_gate covers {len(signals.output_gate)} attention layers, not {num_layers}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    flat = flat_budget(keep_fraction, num_budgeted)
    total = flat * num_layers
    weights = [float(g.float().abs().mean()) ** exponent for g in signals.output_gate]
    # Every layer first gets floor * flat; the rest of the total follows the gates.
    shares = proportional_with_cap(weights, total * (1.0 - floor), num_budgeted * (1.0 - floor))
    return round_to_total([floor * flat + s for s in shares], total, num_budgeted)
