"""The allocation registry and the arithmetic every allocation shares.

An allocation decides how many entries each attention layer keeps beyond the protected prefix:
    fn(keep_fraction, num_budgeted, num_layers, signals=None, **options) -> list[int]
where num_budgeted (m) is a layer's entries outside the protected prefix (n - protected_prefix_len),
the same in every layer of one context. ``flat`` and ``gate`` spend exactly the flat total,
num_layers * round(keep_fraction * m); ``pyramidkv`` rounds each layer as its reference code does
(within num_layers / 2 of that total). None gives a layer more than m.

An allocation registered with ``reads_scores=True`` decides after scoring, per layer *and KV head*:
    fn(keep_fraction, num_budgeted, num_layers, signals=None, *, scores, **options) -> list[list[int]]
where scores[l] is layer l's [kv_heads, m] scores past the protected prefix; it spends the same
total as flat (num_layers * kv_heads * round(p * m)), and the heads of one layer may keep different
counts (the compacted context then folds over (layer, head) cells: ``compact/layout.fold_heads``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from sglang_kvx.signals import ContextSignals

Allocation = Callable[..., list[int]]

ALLOCATIONS: dict[str, Allocation] = {}
# The signals an allocation reads beyond the policy's (the server captures them in the prefill).
ALLOCATION_NEEDS: dict[str, frozenset[str]] = {}
# Why an allocation is not rank-consistent under tensor parallelism (absent: it is).
ALLOCATION_TP_UNSAFE: dict[str, str] = {}
# Allocations that read the policy's scores and budget each KV head (``head_budgets``).
ALLOCATION_READS_SCORES: set[str] = set()


def register_allocation(
    name: str, needs: frozenset[str] = frozenset(), tp_unsafe: str = "", reads_scores: bool = False,
) -> Callable[[Allocation], Allocation]:
    def decorator(fn: Allocation) -> Allocation:
        if name in ALLOCATIONS:
            raise ValueError(f"allocation {name!r} is already registered")
        ALLOCATIONS[name] = fn
        ALLOCATION_NEEDS[name] = frozenset(needs)
        if tp_unsafe:
            ALLOCATION_TP_UNSAFE[name] = tp_unsafe
        if reads_scores:
            ALLOCATION_READS_SCORES.add(name)
        return fn

    return decorator


def allocation_reads_scores(name: str) -> bool:
    """Whether allocation ``name`` budgets each KV head from the scores (``head_budgets``)."""
    get_allocation(name)
    return name in ALLOCATION_READS_SCORES


def allocation_tp_problem(name: str) -> str:
    """Why allocation ``name`` is not rank-consistent under tensor parallelism ("" when it is)."""
    get_allocation(name)
    return ALLOCATION_TP_UNSAFE.get(name, "")


def allocation_needs(name: str) -> frozenset[str]:
    """The signals allocation ``name`` reads (``ContextSignals`` field names)."""
    get_allocation(name)
    return ALLOCATION_NEEDS[name]


def allocation_names() -> list[str]:
    return sorted(ALLOCATIONS)


def get_allocation(name: str) -> Allocation:
    try:
        return ALLOCATIONS[name]
    except KeyError:
        raise ValueError(f"unknown allocation {name!r}; valid choices: {', '.join(allocation_names())}") from None


def layer_budgets(
    allocation: str,
    keep_fraction: float,
    num_budgeted: int,
    num_layers: int,
    signals: ContextSignals | None = None,
    **options: Any,
) -> list[int]:
    """Per attention layer, how many entries it keeps beyond the protected prefix (validated)."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if num_budgeted < 0:
        raise ValueError(f"num_budgeted must be >= 0, got {num_budgeted}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if allocation_reads_scores(allocation):
        raise ValueError(f"allocation {allocation!r} budgets each KV head from the scores; use head_budgets")
    budgets = get_allocation(allocation)(keep_fraction, num_budgeted, num_layers, signals, **options)
    if len(budgets) != num_layers or any(not 0 <= b <= num_budgeted for b in budgets):
        raise AssertionError(f"allocation {allocation!r} returned {budgets} for {num_layers} layers of {num_budgeted} entries")
    return [int(b) for b in budgets]


def head_budgets(
    allocation: str,
    keep_fraction: float,
    scores: list[torch.Tensor],
    signals: ContextSignals | None = None,
    **options: Any,
) -> list[list[int]]:
    """Per attention layer and KV head, how many entries it keeps beyond the protected prefix
    (validated): ``scores[l]`` is layer l's [kv_heads, m] scores past the prefix."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if not allocation_reads_scores(allocation):
        raise ValueError(f"allocation {allocation!r} budgets layers, not heads; use layer_budgets")
    if not scores:
        raise ValueError("no attention layers to budget")
    num_heads, m = scores[0].shape
    budgets = get_allocation(allocation)(keep_fraction, m, len(scores), signals, scores=scores, **options)
    if len(budgets) != len(scores) or any(len(b) != num_heads or any(not 0 <= k <= m for k in b) for b in budgets):
        raise AssertionError(f"allocation {allocation!r} returned {budgets} for {len(scores)} layers x {num_heads} "
                             f"heads of {m} entries")
    return [[int(k) for k in b] for b in budgets]


def flat_budget(keep_fraction: float, num_budgeted: int) -> int:
    """round(p * m), halves rounded up (Python's round() would send 2.5 to 2)."""
    return math.floor(keep_fraction * num_budgeted + 0.5)


def round_to_total(real_budgets: list[float], total: int, cap: int) -> list[int]:
    """Integers within 1 of each real budget, summing exactly to ``total`` (largest remainder).

    Reals are clipped to [0, cap] first. Ties in the remainder go to the earlier layer, so a
    non-increasing sequence of reals stays non-increasing after rounding.
    """
    clipped = [min(max(b, 0.0), float(cap)) for b in real_budgets]
    floors = [math.floor(b) for b in clipped]
    leftover = total - sum(floors)
    by_remainder = sorted(range(len(clipped)), key=lambda i: -(clipped[i] - floors[i]))  # stable
    for i in by_remainder:
        if leftover <= 0:
            break
        if floors[i] < cap:
            floors[i] += 1
            leftover -= 1
    return floors


def proportional_with_cap(weights: list[float], total: float, cap: float) -> list[float]:
    """Split ``total`` in proportion to ``weights``, no share above ``cap``; the excess of a capped
    share is re-split among the others (water filling). Zero total weight splits evenly."""
    shares = [0.0] * len(weights)
    free = list(range(len(weights)))
    remaining = float(total)
    while free:
        weight_sum = sum(weights[i] for i in free)
        for i in free:
            shares[i] = remaining * weights[i] / weight_sum if weight_sum > 0 else remaining / len(free)
        over = [i for i in free if shares[i] > cap]
        if not over:
            break
        for i in over:
            shares[i] = float(cap)
            free.remove(i)
            remaining -= cap
    return shares


def fill_pages(budgets: list[int], num_budgeted: int, protected_prefix_len: int, page_size: int, fold: bool = True) -> list[int]:
    """Budgets raised so that a compacted context fills whole pages of SGLang's paged pool.

    With ``--page-size`` P > 1 a child continues after the context's slots on a fresh page only if
    the context holds a multiple of P slots; a partial last page would be shared by every child.
    The context holds S = ceil(sum of kept / L) slots when layers fold (else the largest layer's
    kept count), each kept = protected_prefix_len + budget. Every cell of the ceil(S / P) pages is
    given an entry: the smallest budgets are raised first, one entry at a time, none above
    ``num_budgeted``. When the pages hold more than the whole context the budgets come back capped
    at ``num_budgeted`` (everything kept) and the slot count is not a page multiple: the caller
    decides (compaction then frees nothing and is skipped).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if page_size == 1 or not budgets:
        return list(budgets)
    num_layers = len(budgets)
    kept = [protected_prefix_len + b for b in budgets]
    slots = -(-sum(kept) // num_layers) if fold else max(kept)
    paged = -(-slots // page_size) * page_size
    if not fold:  # every layer owns the context's slots: each fills them
        return [min(paged - protected_prefix_len, num_budgeted) for _ in budgets]
    out = list(budgets)
    for _ in range(paged * num_layers - sum(kept)):
        open_layers = [i for i in range(num_layers) if out[i] < num_budgeted]
        if not open_layers:
            break
        out[min(open_layers, key=lambda i: (out[i], i))] += 1
    return out
