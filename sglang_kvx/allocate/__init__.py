"""Allocation: how many entries each attention layer keeps (beyond the protected prefix).

``layer_budgets("flat", keep_fraction, num_budgeted, num_layers, signals)`` -> list[int];
``head_budgets("global", keep_fraction, scores)`` -> list[list[int]] (per layer and KV head).
An allocation joins the registry with ``@register_allocation("name")`` on its function.
"""

from sglang_kvx.allocate.base import (
    ALLOCATIONS,
    allocation_names,
    allocation_needs,
    allocation_reads_scores,
    allocation_tp_problem,
    fill_pages,
    flat_budget,
    get_allocation,
    head_budgets,
    layer_budgets,
    register_allocation,
)

# Importing an allocation module registers it.
from sglang_kvx.allocate import flat, gate, global_threshold, pyramid, threshold  # noqa: F401,E402

__all__ = ["ALLOCATIONS", "allocation_names", "allocation_needs", "allocation_reads_scores", "allocation_tp_problem",
           "fill_pages", "flat_budget", "get_allocation", "head_budgets", "layer_budgets", "register_allocation"]
