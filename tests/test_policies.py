"""Each policy's score against an independent reference (explicit loops over heads, queries and keys)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kvx.allocate import allocation_names
from sglang_kvx.policies import ModelTraits, get_policy, policy_names
from sglang_kvx.select import choose_keep_set
from sglang_kvx.signals import ContextSignals

SCORING_POLICIES = ["h2o", "keydiff", "knorm", "pyramidkv", "random", "snapkv", "streamingllm"]
SIGNAL_NAMES = {"keys", "values", "attention", "gdn", "output_gate"}


def make_signals(
    seed: int = 0, num_layers: int = 2, num_q_heads: int = 4, num_kv_heads: int = 2, n: int = 24,
    head_dim: int = 8, window: int = 5, protected_prefix_len: int = 0,
) -> ContextSignals:
    gen = torch.Generator().manual_seed(seed)

    def per_layer(*shape: int) -> list[torch.Tensor]:
        return [torch.randn(*shape, generator=gen) for _ in range(num_layers)]

    return ContextSignals(
        n=n, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        keys=per_layer(num_kv_heads, n, head_dim),
        values=per_layer(num_kv_heads, n, head_dim),
        window_queries=per_layer(num_q_heads, window, head_dim),
        attention_column_sums=[torch.rand(num_q_heads, n, generator=gen) * 5 for _ in range(num_layers)],
        output_gate=[torch.rand(n, num_q_heads, generator=gen) for _ in range(num_layers)],
        protected_prefix_len=protected_prefix_len,
    )


def kept(signals: ContextSignals, policy_name: str, keep_fraction: float, layer: int = 0, **options) -> list[list[int]]:
    return choose_keep_set(get_policy(policy_name)(**options), signals, keep_fraction).positions[layer].tolist()


# --- registry and API -------------------------------------------------------------------------


# Policies whose signals synthetic ones cannot stand in for; each has its own test file
# (test_policies_tri_kvzip.py, test_gatesight.py, test_kvzip_plus.py, test_kvzap.py).
OWN_TEST_POLICIES = {"triattention", "kvzip", "gatesight", "kvzip_plus", "kvzap", "kvzap_linear"}


def test_every_policy_is_registered_with_a_known_allocation_and_signals():
    assert set(SCORING_POLICIES) | OWN_TEST_POLICIES | {"none"} == set(policy_names())
    for name in SCORING_POLICIES:
        cls = get_policy(name)
        assert cls.compacts and cls.name == name
        assert cls.allocation in allocation_names()
        assert cls.needs <= SIGNAL_NAMES, name
    assert get_policy("pyramidkv").allocation == "pyramidkv" and get_policy("snapkv").allocation == "flat"
    assert get_policy("pyramidkv")(beta=7).allocation_options == {"beta": 7, "window_size": 64}


def test_a_dense_model_serves_every_policy():
    dense = ModelTraits("LlamaForCausalLM", num_attention_layers=4, num_kv_heads=2, has_gdn=False, has_output_gate=False)
    for name in SCORING_POLICIES:
        get_policy(name).check_model(dense)  # none of them needs GDN or gate signals


@pytest.mark.parametrize("name", SCORING_POLICIES)
def test_scores_are_per_kv_head_and_entry(name):
    signals = make_signals()
    for layer in range(signals.num_layers):
        scores = get_policy(name)().score(signals, layer)
        assert scores.shape == (signals.num_kv_heads, signals.n) and scores.dtype == torch.float32
        assert not torch.isnan(scores).any()


@pytest.mark.parametrize("name", SCORING_POLICIES)
def test_layer_out_of_range_is_a_clear_error(name):
    with pytest.raises(ValueError, match="attention layer 2 out of range"):
        get_policy(name)().score(make_signals(), 2)


@pytest.mark.parametrize("name,field", [("snapkv", "window_queries"), ("pyramidkv", "window_queries"), ("h2o", "attention_column_sums")])
def test_missing_signal_is_a_clear_error(name, field):
    signals = make_signals()
    setattr(signals, field, None)
    with pytest.raises(ValueError, match=f"{name}.*needs ContextSignals.{field}"):
        get_policy(name)().score(signals, 0)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="kernel_size must be a positive odd"):
        get_policy("snapkv")(kernel_size=4)
    with pytest.raises(ValueError, match="beta must be >= 1"):
        get_policy("pyramidkv")(beta=0.5)
    with pytest.raises(ValueError, match="recent_ratio"):
        get_policy("h2o")(recent_ratio=1.5)
    with pytest.raises(TypeError):
        get_policy("knorm")(window_size=3)


# --- random -----------------------------------------------------------------------------------


def test_random_is_seeded():
    signals = make_signals()
    a, b = get_policy("random")(seed=3), get_policy("random")(seed=3)
    assert torch.equal(a.score(signals, 0), b.score(signals, 0))
    assert not torch.equal(a.score(signals, 0), get_policy("random")(seed=4).score(signals, 0))
    assert not torch.equal(a.score(signals, 0), a.score(signals, 1))
    scores = a.score(signals, 0)
    assert (scores >= 0).all() and (scores < 1).all()


# --- knorm ------------------------------------------------------------------------------------


def test_knorm_keeps_the_lowest_key_norms():
    signals = make_signals(seed=1)
    keys = signals.keys[0]
    scores = get_policy("knorm")().score(signals, 0)
    for kv_head in range(signals.num_kv_heads):
        for i in range(signals.n):
            norm = math.sqrt(sum(x * x for x in keys[kv_head, i].tolist()))
            assert scores[kv_head, i].item() == pytest.approx(-norm, rel=1e-5)
    budget = 6
    keep = kept(signals, "knorm", budget / signals.n)
    for kv_head in range(signals.num_kv_heads):
        norms = [math.dist(keys[kv_head, i].tolist(), [0.0] * signals.head_dim) for i in range(signals.n)]
        assert keep[kv_head] == sorted(sorted(range(signals.n), key=lambda i: norms[i])[:budget])
    assert keep[0] != keep[1]  # heads choose independently


# --- streamingllm -----------------------------------------------------------------------------


def test_streamingllm_keeps_exactly_sinks_and_recent():
    signals = make_signals(n=24)
    keep = kept(signals, "streamingllm", 10 / 24)  # budget 10 = 4 sinks + 6 recent
    assert keep == [[0, 1, 2, 3, *range(18, 24)]] * signals.num_kv_heads
    keep = kept(signals, "streamingllm", 10 / 24, num_sinks=2)
    assert keep == [[0, 1, *range(16, 24)]] * signals.num_kv_heads
    keep = kept(signals, "streamingllm", 3 / 24)  # fewer slots than sinks: the first sinks
    assert keep == [[0, 1, 2]] * signals.num_kv_heads


def test_streamingllm_sinks_in_the_protected_prefix_cost_no_budget():
    signals = make_signals(n=24, protected_prefix_len=2)
    keep = kept(signals, "streamingllm", 10 / 22)  # 2 protected, budget 10: sinks 2, 3 + 8 recent
    assert keep == [[0, 1, 2, 3, *range(16, 24)]] * signals.num_kv_heads


# --- snapkv / pyramidkv -----------------------------------------------------------------------


def snapkv_reference(signals: ContextSignals, layer: int, window: int, kernel: int) -> list[list[float]]:
    """SnapKV by explicit loops: causal softmax of each window query over the keys it sees."""
    keys, queries = signals.keys[layer].tolist(), signals.window_queries[layer].tolist()
    n, group = signals.n, signals.group_size
    queries = [q[len(q) - window :] for q in queries]
    attention = [[0.0] * n for _ in range(signals.num_kv_heads)]
    for q_head in range(signals.num_q_heads):
        kv_head = q_head // group
        for j, query in enumerate(queries[q_head]):
            position = n - window + j
            logits = [sum(a * b for a, b in zip(query, keys[kv_head][i])) / math.sqrt(signals.head_dim) for i in range(position + 1)]
            top = max(logits)
            denominator = sum(math.exp(x - top) for x in logits)
            for i, x in enumerate(logits):
                attention[kv_head][i] += math.exp(x - top) / denominator
    scores = []
    for row in attention:
        before = row[: n - window]
        pooled = [sum(before[j] for j in range(i - kernel // 2, i + kernel // 2 + 1) if 0 <= j < len(before)) / kernel for i in range(len(before))]
        scores.append(pooled + [math.inf] * window)
    return scores


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("window,kernel", [(5, 5), (3, 3), (5, 1)])
def test_snapkv_matches_the_explicit_loop(name, window, kernel):
    signals = make_signals(seed=2, window=5)  # the producer gave 5 queries; the policy may use fewer
    policy = get_policy(name)(window_size=window, kernel_size=kernel)
    for layer in range(signals.num_layers):
        scores = policy.score(signals, layer)
        torch.testing.assert_close(scores, torch.tensor(snapkv_reference(signals, layer, window, kernel)), atol=1e-5, rtol=1e-5)


def test_snapkv_window_always_wins():
    signals = make_signals(seed=3, n=30, window=5, protected_prefix_len=2)
    # Budget exactly the window: nothing else fits, whatever the attention says.
    assert kept(signals, "snapkv", 5 / 28) == [[0, 1, *range(25, 30)]] * signals.num_kv_heads
    # A bigger budget adds the best-attended earlier entries per head.
    keep = kept(signals, "snapkv", 9 / 28)
    reference = snapkv_reference(signals, 0, 5, 5)
    for kv_head, positions in enumerate(keep):
        best = sorted(range(2, 25), key=lambda i: -reference[kv_head][i])[:4]
        assert positions == sorted([0, 1, *best, *range(25, 30)])


# --- h2o --------------------------------------------------------------------------------------


def test_h2o_score_is_the_group_summed_accumulated_attention():
    signals = make_signals(seed=4)
    sums = signals.attention_column_sums[1].tolist()
    scores = get_policy("h2o")().score(signals, 1)
    for kv_head in range(signals.num_kv_heads):
        group = range(kv_head * signals.group_size, (kv_head + 1) * signals.group_size)
        expected = [sum(sums[q][i] for q in group) for i in range(signals.n)]
        assert scores[kv_head].tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("budget,protected", [(9, 0), (10, 3), (1, 0)])
def test_h2o_keeps_half_heavy_hitters_half_recent(budget, protected):
    signals = make_signals(seed=5, n=24, protected_prefix_len=protected)
    keep = kept(signals, "h2o", budget / (24 - protected))
    sums = signals.attention_column_sums[0]
    num_recent = budget // 2
    recent = list(range(24 - num_recent, 24))
    for kv_head in range(signals.num_kv_heads):
        accumulated = sums[kv_head * 2 : kv_head * 2 + 2].sum(0).tolist()
        candidates = [i for i in range(protected, 24) if i not in recent]
        heavy = sorted(candidates, key=lambda i: -accumulated[i])[: budget - num_recent]
        assert keep[kv_head] == sorted([*range(protected), *heavy, *recent])


# --- keydiff ----------------------------------------------------------------------------------


def test_keydiff_matches_the_cosine_to_the_mean_key_direction():
    signals = make_signals(seed=6)
    keys = signals.keys[0].tolist()
    scores = get_policy("keydiff")().score(signals, 0)
    for kv_head in range(signals.num_kv_heads):
        units = [[x / math.hypot(*k) for x in k] for k in keys[kv_head]]
        anchor = [sum(col) / len(units) for col in zip(*units)]
        for i, k in enumerate(keys[kv_head]):
            cosine = sum(a * b for a, b in zip(k, anchor)) / (math.hypot(*k) * math.hypot(*anchor))
            assert scores[kv_head, i].item() == pytest.approx(-cosine, abs=1e-5)


def test_keydiff_keeps_the_odd_key_out():
    signals = make_signals(seed=7)
    direction = torch.randn(signals.head_dim, generator=torch.Generator().manual_seed(0))
    keys = direction.expand(signals.num_kv_heads, signals.n, -1) * torch.rand(signals.num_kv_heads, signals.n, 1) + 0.05 * torch.randn(signals.num_kv_heads, signals.n, signals.head_dim)
    keys[0, 11] = -direction
    keys[1, 17] = -direction
    signals.keys[0] = keys
    assert kept(signals, "keydiff", 1 / signals.n) == [[11], [17]]
