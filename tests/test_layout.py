"""The folded layout of a compacted context's kept entries (compact/layout.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from sglang_kvx.compact.layout import Borrowed, LayerCells, fold_layers


def cells_of(layout, layer):
    """Every (buffer layer, slot) that holds one of ``layer``'s ranks, in rank order."""
    cells = layout.layers[layer]
    own = [(layer, slot) for slot in range(cells.own)]
    return own + [(b.layer, slot) for b in cells.borrowed for slot in range(b.start, b.end)]


@pytest.mark.parametrize("kept", [[215, 605], [10, 10, 10], [0, 7], [3, 1, 8, 2], [100, 1, 1, 1, 1, 1]])
def test_each_layer_gets_its_entries_in_distinct_cells_of_the_mean_number_of_slots(kept) -> None:
    layout = fold_layers(kept)
    assert layout.num_slots == -(-sum(kept) // len(kept))
    used = [cells_of(layout, layer) for layer in range(len(kept))]
    assert [len(u) for u in used] == kept == [c.kept for c in layout.layers]
    flat = list(itertools.chain.from_iterable(used))
    assert len(set(flat)) == len(flat)  # no cell holds two entries
    assert all(0 <= slot < layout.num_slots for _, slot in flat)
    assert layout.borrowed_entries == sum(max(0, k - layout.num_slots) for k in kept)


def test_random_budgets_fold_without_waste() -> None:
    rng = random.Random(0)
    for _ in range(200):
        kept = [rng.randrange(0, 50) for _ in range(rng.randrange(1, 7))]
        if not sum(kept):
            continue
        layout = fold_layers(kept)
        flat = [cell for layer in range(len(kept)) for cell in cells_of(layout, layer)]
        assert len(set(flat)) == len(flat) == sum(kept)
        assert layout.num_slots * len(kept) - sum(kept) < len(kept)  # less than one slot left over


def test_flat_budgets_are_the_plain_layout() -> None:
    layout = fold_layers([40, 40, 40])
    assert layout.is_all_plain and layout.num_slots == 40 and layout.borrowed_entries == 0


def test_overflow_goes_into_the_cells_a_smaller_layer_leaves_empty() -> None:
    layout = fold_layers([2, 6])
    assert layout.num_slots == 4
    assert layout.layers == (LayerCells(2), LayerCells(4, (Borrowed(0, 2, 4),)))
    assert not layout.is_plain(0) and not layout.is_plain(1)


def test_without_folding_a_context_holds_the_largest_layer() -> None:
    layout = fold_layers([2, 6], fold=False)
    assert layout.num_slots == 6 and layout.layers == (LayerCells(2), LayerCells(6)) and layout.is_plain(1)


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError):
        fold_layers([])
    with pytest.raises(ValueError):
        fold_layers([3, -1])
