"""Allocation (per-layer budgets) and selection (per-head keep-sets): totals, shapes, the protected prefix, bad input."""

from __future__ import annotations

import pytest
import torch

from sglang_kvx.allocate import allocation_names, layer_budgets
from sglang_kvx.policies import get_policy
from sglang_kvx.select import KeepSet, choose_keep_set, select_keep_set
from test_policies import SCORING_POLICIES, make_signals

# --- allocation -------------------------------------------------------------------------------


def test_allocations_registered():
    assert {"flat", "pyramidkv", "gate"} <= set(allocation_names())


@pytest.mark.parametrize("keep_fraction,num_budgeted,expected", [(0.1, 1000, 100), (0.25, 10, 3), (0.35, 10, 4), (0.01, 10, 0), (1.0, 7, 7)])
def test_flat_keeps_round_p_m_in_every_layer(keep_fraction, num_budgeted, expected):
    assert layer_budgets("flat", keep_fraction, num_budgeted, 5) == [expected] * 5


@pytest.mark.parametrize("num_layers", [1, 2, 7, 32])
@pytest.mark.parametrize("keep_fraction", [0.02, 0.1, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("num_budgeted", [0, 37, 1000])
def test_pyramid_spends_p_m_per_layer_up_to_rounding_and_decreases_with_depth(num_layers, keep_fraction, num_budgeted):
    # kvpress's rule rounds layer by layer: within L / 2 of L * p * m, not always the flat total
    # (the worked cases are in test_pyramid_budgets.py).
    pyramid = layer_budgets("pyramidkv", keep_fraction, num_budgeted, num_layers)
    assert abs(sum(pyramid) - num_layers * keep_fraction * num_budgeted) <= num_layers / 2 + 1e-9
    assert all(0 <= b <= num_budgeted for b in pyramid)
    assert all(a >= b for a, b in zip(pyramid, pyramid[1:]))


def test_pyramid_follows_the_reference_shape():
    # mean 1638.4, beta 20: the last layer gets 1638.4 / 20 = 81.92, the first 2 * 1638.4 - 81.92, linear between.
    budgets = layer_budgets("pyramidkv", 0.4, 4096, 8)
    assert budgets[0] == 3195 and budgets[-1] == 82
    steps = [a - b for a, b in zip(budgets, budgets[1:])]
    assert max(steps) - min(steps) <= 1
    assert layer_budgets("pyramidkv", 0.4, 4096, 8, beta=1.0) == [1638] * 8  # beta 1 is flat
    # Capped at m - w = 448 (window 64), the last layer 2 * 256 - 448 = 64: the kvpress figures.
    assert layer_budgets("pyramidkv", 0.5, 512, 4) == [448, 320, 192, 64]
    # The last layer would get fewer than the window's 64 entries: flat SnapKV budgets.
    assert layer_budgets("pyramidkv", 0.1, 1000, 8) == [100] * 8


def test_pyramid_at_p_one_keeps_everything():
    assert layer_budgets("pyramidkv", 1.0, 50, 6) == [50] * 6


def gate_signals(layer_gate_means: list[float], n: int = 101) -> object:
    signals = make_signals(num_layers=len(layer_gate_means), n=n)
    signals.output_gate = [torch.full((n, signals.num_q_heads), mean) for mean in layer_gate_means]
    return signals


def test_gate_budgets_follow_the_mean_output_gate():
    signals = gate_signals([0.1, 0.2, 0.3, 0.4])
    budgets = layer_budgets("gate", 0.5, 100, 4, signals)
    assert sum(budgets) == 4 * 50
    assert budgets == [20, 40, 60, 80]
    assert layer_budgets("gate", 0.5, 100, 4, signals, exponent=0.0) == [50] * 4  # exponent 0 is flat


def test_a_floor_gives_every_layer_part_of_the_flat_budget_first():
    signals = gate_signals([0.1, 0.2, 0.3, 0.4])
    # floor 0.5: 25 each, then the other 100 entries by the gates (10, 20, 30, 40).
    assert layer_budgets("gate", 0.5, 100, 4, signals, floor=0.5) == [35, 45, 55, 65]
    assert layer_budgets("gate", 0.5, 100, 4, signals, floor=1.0) == [50] * 4
    assert layer_budgets("gate", 0.5, 100, 4, signals, floor=0.0) == [20, 40, 60, 80]
    # The cap still holds: the gated share of a layer never takes it past its entries.
    assert max(layer_budgets("gate", 0.9, 100, 3, gate_signals([0.9, 0.05, 0.05]), floor=0.5)) <= 100
    with pytest.raises(ValueError, match="floor must be in"):
        layer_budgets("gate", 0.5, 100, 4, signals, floor=1.5)


def test_gate_caps_a_layer_at_its_entries_and_passes_on_the_excess():
    signals = gate_signals([0.9, 0.05, 0.05])
    budgets = layer_budgets("gate", 0.6, 100, 3, signals)
    assert budgets == [100, 40, 40]


def test_gate_needs_the_output_gate():
    signals = make_signals()
    signals.output_gate = None
    with pytest.raises(ValueError, match="needs ContextSignals.output_gate"):
        layer_budgets("gate", 0.5, 10, 2, signals)


@pytest.mark.parametrize(
    "args,match",
    [
        (("flat", 0.0, 10, 2), r"keep_fraction must be in \(0, 1\]"),
        (("flat", 1.5, 10, 2), r"keep_fraction must be in \(0, 1\]"),
        (("flat", 0.5, -1, 2), "num_budgeted must be >= 0"),
        (("flat", 0.5, 10, 0), "num_layers must be >= 1"),
        (("pyramid", 0.5, 10, 2), "unknown allocation 'pyramid'; valid choices: flat, gate, global, pyramidkv"),
        (("global", 0.5, 10, 2), "allocation 'global' budgets each KV head from the scores; use head_budgets"),
        (("pyramidkv", 0.5, 10, 2), None),
    ],
)
def test_bad_allocation_inputs_raise(args, match):
    if match is None:
        layer_budgets(*args)  # the control: the same call with good values works
        return
    with pytest.raises(ValueError, match=match):
        layer_budgets(*args)


# --- selection --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCORING_POLICIES)
@pytest.mark.parametrize("protected", [0, 3])
def test_keep_fraction_one_keeps_everything(name, protected):
    signals = make_signals(protected_prefix_len=protected)
    keep_set = choose_keep_set(get_policy(name)(), signals, 1.0)
    everything = torch.arange(signals.n).expand(signals.num_kv_heads, -1)
    assert keep_set.num_layers == signals.num_layers
    for positions in keep_set.positions:
        assert torch.equal(positions, everything)


@pytest.mark.parametrize("name", SCORING_POLICIES)
def test_protected_prefix_is_kept_outside_the_budget(name):
    signals = make_signals(seed=8, n=30, protected_prefix_len=7)
    keep_set = choose_keep_set(get_policy(name)(), signals, 0.25)
    budgets = layer_budgets(get_policy(name).allocation, 0.25, 23, signals.num_layers)
    assert keep_set.kept_per_layer == [7 + b for b in budgets]
    for positions in keep_set.positions:
        assert (positions[:, :7] == torch.arange(7)).all()
        assert (positions[:, 1:] > positions[:, :-1]).all()  # ascending, no repeats


def test_protected_prefix_wins_even_with_the_lowest_scores():
    scores = torch.arange(10, dtype=torch.float32).expand(2, -1).clone()  # the prefix scores lowest
    keep_set = select_keep_set([scores], [2], protected_prefix_len=3)
    assert keep_set.positions[0].tolist() == [[0, 1, 2, 8, 9]] * 2


def test_heads_keep_different_positions_when_their_scores_differ():
    scores = torch.tensor([[9.0, 1, 8, 2, 7, 3], [1.0, 9, 2, 8, 3, 7]])
    keep_set = select_keep_set([scores, scores.flip(0)], [3, 2], protected_prefix_len=0)
    assert keep_set.positions[0].tolist() == [[0, 2, 4], [1, 3, 5]]
    assert keep_set.positions[1].tolist() == [[1, 3], [0, 2]]
    assert keep_set.mask(0).tolist() == [[True, False, True, False, True, False], [False, True, False, True, False, True]]


def test_budget_larger_than_available_is_clamped():
    keep_set = select_keep_set([torch.randn(2, 10)], [100], protected_prefix_len=4)
    assert keep_set.positions[0].tolist() == [list(range(10))] * 2


@pytest.mark.parametrize(
    "scores,budgets,protected,match",
    [
        ([torch.zeros(2, 10)], [3], 11, r"protected prefix of 11 tokens is longer than the context \(10 tokens\)"),
        ([torch.zeros(2, 10)], [3], -1, "protected_prefix_len must be >= 0"),
        ([torch.zeros(2, 10)], [3, 3], 0, "1 layers of scores but 2 budgets"),
        ([torch.zeros(2, 10)], [-1], 0, "layer 0: budgets must be >= 0, one per KV head"),
        ([torch.zeros(2, 10), torch.zeros(2, 9)], [3, 3], 0, r"layer 1: scores must be \[kv_heads, 10\]"),
        ([], [], 0, "no attention layers"),
    ],
)
def test_bad_selection_inputs_raise(scores, budgets, protected, match):
    with pytest.raises(ValueError, match=match):
        select_keep_set(scores, budgets, protected)


def test_choose_keep_set_refuses_a_prefix_longer_than_the_context():
    signals = make_signals(n=10, protected_prefix_len=11)
    with pytest.raises(ValueError, match=r"protected prefix of 11 tokens does not fit the context \(10 tokens\)"):
        choose_keep_set(get_policy("knorm")(), signals, 0.5)


def test_choose_keep_set_can_override_the_allocation():
    signals = gate_signals([0.1, 0.3], n=40)
    keep_set = choose_keep_set(get_policy("snapkv")(), signals, 0.5, allocation="gate")
    assert keep_set.kept_per_layer == [10, 30]
    pyramid = choose_keep_set(get_policy("pyramidkv")(), make_signals(num_layers=4, n=200), 0.5)
    assert pyramid.kept_per_layer == layer_budgets("pyramidkv", 0.5, 200, 4) and pyramid.kept_per_layer[0] > pyramid.kept_per_layer[-1]


def test_keep_set_mask_matches_positions():
    keep_set = KeepSet(positions=[torch.tensor([[0, 3], [1, 2]])], n=4, protected_prefix_len=0)
    assert keep_set.mask(0).tolist() == [[True, False, False, True], [False, True, True, False]]
    assert keep_set.kept_per_layer == [2]


# --- one threshold over every layer and KV head (KVzip's rule) ----------------------------------


def test_the_global_allocation_keeps_the_best_entries_over_every_layer_and_head():
    """The keep-set under ``global`` is the model-wide top-T of the scores past the protected prefix
    (T the flat total), computed here independently; heads of one layer keep different counts."""
    from sglang_kvx.allocate import head_budgets

    g = torch.Generator().manual_seed(4)
    layers, heads, n, protected, p = 4, 3, 40, 3, 0.3
    # Layers and heads on different scales, as KVzip's scores are: a flat split would keep other entries.
    scores = [torch.rand(heads, n, generator=g) * torch.tensor([[1.0], [4.0], [0.2]]) * (layer + 1) for layer in range(layers)]
    keep = select_keep_set(scores, head_budgets("global", p, [s[:, protected:] for s in scores]), protected)
    assert keep.per_head and len({k for layer in keep.kept_per_head for k in layer}) > 1
    total = layers * heads * round(p * (n - protected))
    past = torch.stack(scores)[..., protected:]
    threshold = past.flatten().sort(descending=True).values[total - 1]
    for layer in range(layers):
        expected = torch.zeros(heads, n, dtype=torch.bool)
        expected[:, :protected] = True
        expected[:, protected:] = past[layer] >= threshold
        assert torch.equal(keep.mask(layer), expected)
    assert sum(map(sum, keep.kept_per_head)) == total + layers * heads * protected
    # The same scores under the flat allocation: every head the same count, another keep-set.
    flat = choose_keep_set_from(scores, p, protected)
    assert not flat.per_head and any(not torch.equal(flat.mask(l), keep.mask(l)) for l in range(layers))


def choose_keep_set_from(scores, p, protected):
    from sglang_kvx.allocate import layer_budgets

    return select_keep_set(scores, layer_budgets("flat", p, scores[0].shape[1] - protected, len(scores)), protected)
