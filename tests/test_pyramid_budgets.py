"""PyramidKV's layer budgets against the reference rule (kvpress's PyramidKVPress), worked out by hand.

The rule, for m entries per layer, keep fraction p, L layers, observation window w, beta = 20:
    a = p * m;  last = a / beta;  first = 2a - last
    if first >= m - w:  first = m - w;  last = 2a - first            (the cap)
    if not m >= first >= last >= w:  every layer gets round(a)       (the SnapKV fallback)
    else layer l gets round(first - l * (first - last) / (L - 1))    (Python round: halves to even)
Every expected list below was computed by hand from these lines (the arithmetic is in the
comments), not by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from sglang_kvx.allocate import layer_budgets
from sglang_kvx.policies import get_policy
from sglang_kvx.select import choose_keep_set
from test_policies import make_signals

CASES = [
    # (m, L, p, w, expected)
    # The case, kvpress's own figures: a = 256, last 12.8, first 499.2 >= 448 -> capped:
    # first 448, last 512 - 448 = 64 >= 64; step 384 / 3 = 128. (The old rule gave [499, 337, 175, 13].)
    (512, 4, 0.5, 64, [448, 320, 192, 64]),
    # The README's model (2 attention layers, 2K) at p = 0.5: a = 1024, first 1996.8 >= 1984 -> capped:
    # first 1984, last 2048 - 1984 = 64.
    (2048, 2, 0.5, 64, [1984, 64]),
    # Uncapped pyramid: a = 1638.4, last 81.92 >= 64, first 3194.88 < 4032; step 3112.96 / 7 = 444.70857...
    # reals 3194.88, 2750.17, 2305.46, 1860.75, 1416.05, 971.34, 526.63, 81.92 (sum 13107.2).
    (4096, 8, 0.4, 64, [3195, 2750, 2305, 1861, 1416, 971, 527, 82]),
    # Fallback, last layer under the window: a = 204.8, last 10.24 < 64 -> round(204.8) = 205 everywhere.
    (2048, 2, 0.1, 64, [205, 205]),
    # The README's other fractions at 2K all fall back: a = 409.6 / 102.4 / 40.96.
    (2048, 2, 0.2, 64, [410, 410]),
    (2048, 2, 0.05, 64, [102, 102]),
    (2048, 2, 0.02, 64, [41, 41]),
    # The context at p = 0.1: a = 51.2, last 2.56 < 64 -> 51.
    (512, 4, 0.1, 64, [51, 51, 51, 51]),
    # Capped, then falls back: a = 230.4, first 449.28 >= 448 -> 448, last 460.8 - 448 = 12.8 < 64 -> 230.
    (512, 4, 0.45, 64, [230, 230, 230, 230]),
    # p > 1/2, capped and kept: a = 358.4, first 448, last 716.8 - 448 = 268.8; step 179.2 / 3 = 59.733...
    # reals 448, 388.27, 328.53, 268.8.
    (512, 4, 0.7, 64, [448, 388, 329, 269]),
    # Another window: a = 500, first 975 >= 968 -> capped: first 968, last 1000 - 968 = 32 >= 32; step 468.
    (1000, 3, 0.5, 32, [968, 500, 32]),
    # w = 16: a = 300, last 15 < 16 -> fallback 300.
    (1000, 5, 0.3, 16, [300, 300, 300, 300, 300]),
    # w = 8: last 15 >= 8, first 585 < 992; step 570 / 4 = 142.5: reals 585, 442.5, 300, 157.5, 15;
    # halves go to the even neighbour: 442, 158.
    (1000, 5, 0.3, 8, [585, 442, 300, 158, 15]),
    # a = 102.5, first 199.875 >= 141 -> capped: first 141, last 205 - 141 = 64; step 38.5: 141, 102.5 -> 102, 64.
    (205, 3, 0.5, 64, [141, 102, 64]),
    # m < 2w: a = 62.5, capped first 61 < last 64 -> fallback round(62.5) = 62 (half to even; flat gives 63).
    (125, 3, 0.5, 64, [62, 62, 62]),
    # Keep everything: a = 50, first 97.5 >= 50 - 64 -> first -14, last 114: no pyramid -> 50.
    (50, 6, 1.0, 64, [50] * 6),
    # w = 0 and p = 1: first 2m - m/20 >= m -> capped first m, last m: flat m.
    (40, 3, 1.0, 0, [40, 40, 40]),
    # Nothing to keep.
    (0, 3, 0.5, 64, [0, 0, 0]),
    # One attention layer: round(a) = round(25.6) = 26.
    (64, 1, 0.4, 8, [26]),
]


@pytest.mark.parametrize("num_budgeted,num_layers,keep_fraction,window_size,expected", CASES)
def test_pyramid_budgets_follow_the_reference_rule(num_budgeted, num_layers, keep_fraction, window_size, expected):
    assert layer_budgets("pyramidkv", keep_fraction, num_budgeted, num_layers, window_size=window_size) == expected


def test_default_window_is_64_and_beta_20():
    assert layer_budgets("pyramidkv", 0.5, 512, 4) == [448, 320, 192, 64]
    # beta 4: a = 256, last 64, first 448 -> at the cap (448 >= 448): first 448, last 64. Same here.
    assert layer_budgets("pyramidkv", 0.5, 512, 4, beta=4) == [448, 320, 192, 64]
    # beta 1 is flat: last = first = a = 300 (>= 64, < 936).
    assert layer_budgets("pyramidkv", 0.3, 1000, 4, beta=1.0) == [300] * 4


def test_total_is_p_m_per_layer_up_to_rounding_not_always_the_flat_total():
    budgets = layer_budgets("pyramidkv", 0.4, 4096, 8)
    flat = layer_budgets("flat", 0.4, 4096, 8)
    assert sum(budgets) == 13107 and sum(flat) == 8 * 1638 == 13104
    assert abs(sum(budgets) - 0.4 * 4096 * 8) <= 8 / 2


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="beta must be >= 1"):
        layer_budgets("pyramidkv", 0.5, 100, 2, beta=0.5)
    with pytest.raises(ValueError, match="window_size must be >= 0"):
        layer_budgets("pyramidkv", 0.5, 100, 2, window_size=-1)


def test_the_policy_passes_its_window_and_the_budget_is_beyond_the_protected_prefix():
    policy = get_policy("pyramidkv")(window_size=32)
    assert policy.allocation_options == {"beta": 20.0, "window_size": 32}
    # n = 1010 with a 10-token protected prefix: m = 1000, p = 0.5, w = 32, L = 3 -> [968, 500, 32].
    signals = make_signals(num_layers=3, n=1010, protected_prefix_len=10)
    assert choose_keep_set(policy, signals, 0.5).kept_per_layer == [10 + 968, 10 + 500, 10 + 32]
    # Default window 64 on the case: m = 512, L = 4.
    assert choose_keep_set(get_policy("pyramidkv")(), make_signals(num_layers=4, n=512), 0.5).kept_per_layer == [448, 320, 192, 64]


def test_gatesight_under_pyramid_budgets():
    from test_gatesight import _random_mlp, _signals

    from sglang_kvx.gatesight.estimator import GateSightEstimator
    from sglang_kvx.gatesight.features import num_features
    from sglang_kvx.policies.gatesight import GateSightPolicy

    w1, b1, w2, b2 = _random_mlp(features=num_features(4))
    estimator = GateSightEstimator(w1, b1, w2, b2, feature_mean=torch.zeros(2, num_features(4)),
                                   feature_std=torch.ones(2, num_features(4)), manifest={"gdn_window": 6})
    policy = GateSightPolicy(estimator=estimator, impl="torch")
    signals = _signals(n=200)
    # m = 200, w = 64 (the rule's default under another policy's scores): a = 100, first 195 >= 136 -> capped:
    # first 136, last 200 - 136 = 64.
    assert choose_keep_set(policy, signals, 0.5, allocation="pyramidkv").kept_per_layer == [136, 64]
    # a = 40, last 2 < 64 -> the flat 40 in both layers, as gatesight@flat.
    assert choose_keep_set(policy, signals, 0.2, allocation="pyramidkv").kept_per_layer == [40, 40]
    assert choose_keep_set(policy, signals, 0.2, allocation="flat").kept_per_layer == [40, 40]

