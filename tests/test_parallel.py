"""Parallel serving: data parallelism (a compacted context's children reach the DP rank that
holds it) and tensor parallelism (each rank compacts its own KV heads).

Unit tests for the routing table and the CPU thread-binding default, then real servers with
``--dp-size 2`` and ``--tp-size 2`` (two scheduler processes on this machine's cores) checked
against the HF oracle.
"""

from __future__ import annotations

import random
import time

import pytest
import requests
import torch

from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.adapter.plugin import cpu_thread_binding
from sglang_kvx.serve.affinity import ContextAffinity, prefix_hashes

from server_pool import spec


def test_children_follow_their_context_and_parents_spread() -> None:
    affinity = ContextAffinity()
    doc_a, doc_b = list(range(10, 300)), list(range(500, 700))
    assert affinity.route(doc_a, is_parent=True, active_ranks=[0, 1]) == 0
    assert affinity.route(doc_b, is_parent=True, active_ranks=[0, 1]) == 1  # the rank with fewer pins
    for _ in range(3):
        assert affinity.route(doc_a + [1, 2, 3], is_parent=False, active_ranks=[0, 1]) == 0
        assert affinity.route(doc_b + [4], is_parent=False, active_ranks=[0, 1]) == 1
    # The same context under other settings stays where its first copy is.
    assert affinity.route(doc_b, is_parent=True, active_ranks=[0, 1]) == 1
    # Unrelated requests, and a prompt that is only part of a context, are left to SGLang.
    assert affinity.route([7, 8, 9], is_parent=False, active_ranks=[0, 1]) is None
    assert affinity.route(doc_a[:100], is_parent=False, active_ranks=[0, 1]) is None
    # A rank that left is not routed to.
    assert affinity.route(doc_a + [1], is_parent=False, active_ranks=[1]) is None


def test_the_longest_pinned_context_wins_and_old_pins_are_forgotten() -> None:
    affinity = ContextAffinity(capacity=2)
    short, longer = list(range(50)), list(range(80))
    assert affinity.route(short, True, [0, 1]) == 0
    assert affinity.route(longer, True, [0, 1]) == 0  # starts with a pinned context: same rank
    affinity._pin((len(longer), prefix_hashes(longer)[-1]), 1)  # move it, to see which one wins
    assert affinity.route(longer + [99], False, [0, 1]) == 1
    assert affinity.route(list(range(200, 260)), True, [0, 1]) is not None  # a third pin evicts the oldest
    assert len(affinity._rank_of) == 2
    assert affinity.route(short + [99], False, [0, 1]) is None
    with pytest.raises(ValueError):
        ContextAffinity(capacity=0)


def test_prefix_hashes_tell_prefixes_apart() -> None:
    h = prefix_hashes([1, 2, 3])
    assert len(h) == 4 and h[0] == 0
    assert prefix_hashes([1, 2, 3, 4])[:4] == h
    assert prefix_hashes([0, 2, 3])[3] != h[3]


@pytest.mark.parametrize(
    ("cores", "ranks", "expected"),
    [([0, 1], 2, "0|1"), ([0, 1, 2, 3], 2, "0-1|2-3"), ([0, 2, 4, 6], 2, "0,2|4,6"), ([0, 1], 3, "0|1|0"), ([5], 2, "5|5")],
)
def test_cpu_thread_binding_splits_the_cores(cores, ranks, expected) -> None:
    assert cpu_thread_binding(cores, ranks) == expected


def test_start_up_refuses_a_policy_ranks_would_disagree_on(launch_parser, demo_paths) -> None:
    """Every served policy is rank-consistent; one that declares otherwise (``tp_unsafe``) is refused."""
    from sglang_kvx.policies import get_policy, servable_policy_names

    assert [p for p in servable_policy_names() if get_policy(p).tp_unsafe] == []
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--kvx-policy-modules", "throwaway_policy",
                                 "--kvx-policy", "_throwaway_rank_local", "--kvx-keep-fraction", "0.2",
                                 "--tp-size", "2", "--max-total-tokens", "4096")
    assert result.returncode == 2 and "--kvx-policy _throwaway_rank_local is not supported with --tp-size 2" in result.stderr, \
        result.stderr[-2000:]


def test_rank_kv_heads_follow_sglangs_split() -> None:
    from sglang_kvx.signals import rank_kv_heads

    assert [rank_kv_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_kv_heads(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated heads
    with pytest.raises(ValueError):
        rank_kv_heads(3, 0, 2)


@pytest.mark.slow
def test_children_on_a_two_rank_server_reuse_the_compacted_context(demo_paths, references, server_pool) -> None:
    name = "tiny-llama"
    ref = references[name]
    rng = random.Random(11)
    context = ref.encode(" ".join(rng.choice(WORDS) for _ in range(200)) + "\n")
    questions = [ref.encode(f"Question {i}: which word comes next? Answer:") for i in range(4)]
    settings = {"custom_params": {"kvx": {"policy": "keydiff", "keep_fraction": 0.3}}}
    server = server_pool.get(spec(demo_paths[name], "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.3", "--dp-size", "2",
                                  max_total_tokens=4096))
    response = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **settings}})
    assert response.status_code == 200, response.text
    answers = []
    for question in questions:
        response = server.generate({"input_ids": context + question,
                                    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, **settings}})
        assert response.status_code == 200, response.text
        answers.append(response.json()["output_ids"])
    ranks = server.stats()["ranks"]
    keep_sets = requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
    assert len(ranks) == 2
    holding = [r for r in ranks if r["compacted_contexts"]]
    assert len(holding) == 1 and holding[0]["compacted_contexts"][0]["reuse_count"] == len(questions)
    keep = [torch.tensor(layer) for layer in keep_sets[0]["positions"]]
    for question, answer in zip(questions, answers):
        assert answer == ref.compacted_greedy(context, keep, question, 6)


def two_ranks_spec(path):
    """The one ``--tp-size 2`` server of the suite (the hybrid: one KV head, two of the four query
    heads' output gates and two of the four value heads of every GDN layer on each rank); the
    combination matrix's ``tp`` mode shares it."""
    return spec(path, "--kvx-policy", "gatesight", "--kvx-keep-fraction", "0.2", "--tp-size", "2", max_total_tokens=4096)


@pytest.fixture
def two_ranks(demo_paths, references, server_pool):
    name = "tiny-hybrid-deep"
    return server_pool.get(two_ranks_spec(demo_paths[name])), references[name]


@pytest.mark.slow
def test_tensor_parallel_ranks_compact_their_own_heads(two_ranks) -> None:
    """--tp-size 2: each rank holds one KV head and compacts it; children equal the oracle applying
    the full keep-set (both heads) for flat and pyramid allocations and KVzip's second pass."""
    from sglang_kvx.policies import get_policy
    from sglang_kvx.reference.kvzip import reconstruction_attention
    from sglang_kvx.reference.signals import context_signals
    from sglang_kvx.select import choose_keep_set

    server, ref = two_ranks
    failed = server.stats()["compactions_failed"]
    rng = random.Random(12)
    context = ref.encode(" ".join(rng.choice(WORDS) for _ in range(200)) + "\n")
    question = ref.encode("Question: which word comes next? Answer:")
    for policy in ("keydiff", "snapkv", "pyramidkv", "kvzip"):
        # PyramidKV's reference budgets are flat unless its last layer keeps the 64-token window.
        fraction = 0.6 if policy == "pyramidkv" else 0.3
        # KVzip's own budgets are one threshold over every KV head, which a rank cannot see: flat here.
        flat = {"allocation": "flat"} if policy == "kvzip" else {}
        settings = {"custom_params": {"kvx": {"policy": policy, "keep_fraction": fraction, **flat}}}
        response = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **settings}})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 120  # KVzip: every rank runs the same reconstruction passes first
        while server.stats()["second_passes_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        response = server.generate({"input_ids": context + question,
                                    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, **settings}})
        assert response.status_code == 200, response.text
        signals = context_signals(ref, context)
        if policy == "kvzip":
            signals.reconstruction_attention = reconstruction_attention(ref, context)
        keep = choose_keep_set(get_policy(policy)(), signals, fraction, **flat)
        assert response.json()["output_ids"] == ref.compacted_greedy(context, keep.positions, question, 6), policy
    refused = server.generate({"input_ids": context, "sampling_params": {
        "max_new_tokens": 0, "custom_params": {"kvx": {"policy": "kvzip", "keep_fraction": 0.2}}}})
    assert refused.status_code == 400 and "allocation 'global' is not supported with --tp-size 2" in refused.text
    stats = server.stats()
    assert stats["compactions_failed"] == failed, stats["last_compaction_error"]
    assert sorted(c["policy"] for c in stats["compacted_contexts"]) == ["keydiff", "kvzip", "pyramidkv", "snapkv"]


@pytest.mark.slow
def test_gatesight_and_gate_budgets_under_tensor_parallelism(two_ranks, compacting_hybrid) -> None:
    """--tp-size 2 on the hybrid: the ranks gather their output gates and GDN signals, so GateSight's
    features and the gate budgets are the whole model's: the keep-set equals the single-rank
    server's, and the children equal the oracle applying it."""
    ref = compacting_hybrid[1]
    rng = random.Random(13)
    context = ref.encode(" ".join(rng.choice(WORDS) for _ in range(260)) + "\n")
    questions = [ref.encode(f"Question {i}: which word comes next? Answer:") for i in range(2)]
    cases = [("gatesight", "gate", 0.2), ("gatesight", None, 0.1), ("snapkv", "gate", 0.3)]

    def run(server) -> tuple[list, list, list]:
        kept, keeps, answers = [], [], []
        failed = server.stats()["compactions_failed"]
        for policy, allocation, fraction in cases:
            kvx = {"policy": policy, "keep_fraction": fraction, **({"allocation": allocation} if allocation else {})}
            settings = {"custom_params": {"kvx": kvx}}
            response = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **settings}})
            assert response.status_code == 200, response.text
            entries = [e for e in requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
                       if e["policy"] == policy and e["keep_fraction"] == fraction]
            assert len(entries) == 1
            kept.append(entries[0]["kept_entries"])
            keeps.append([torch.tensor(layer) for layer in entries[0]["positions"]])
            answers.append([server.generate({"input_ids": context + q, "return_logprob": True, "sampling_params": {
                "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, **settings}}).json() for q in questions])
        assert server.stats()["compactions_failed"] == failed, server.stats()["last_compaction_error"]
        return kept, keeps, answers

    kept_1, keeps_1, answers_1 = run(compacting_hybrid[0])
    kept_2, keeps_2, answers_2 = run(two_ranks[0])
    assert kept_2 == kept_1  # every rank's budgets came from the whole model's gates
    for (policy, allocation, fraction), one, two, by_one, by_two in zip(cases, keeps_1, keeps_2, answers_1, answers_2):
        for layer_one, layer_two in zip(one, two):
            assert layer_two.shape[0] == 1 and torch.equal(layer_two[0], layer_one[0]), (policy, allocation)  # rank 0's head
        for question, body_one, body_two in zip(questions, by_one, by_two):
            expected_ids, expected_lp = ref.compacted_generate(context, one, question, 6)
            assert body_one["output_ids"] == expected_ids == body_two["output_ids"], (policy, allocation)
            served_lp = [e[0] for e in body_two["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4


@pytest.mark.slow
@pytest.mark.long
def test_every_feature_under_two_ranks_is_served_alike_or_refused_by_name(two_ranks) -> None:
    """The combination matrix's ``tp`` mode (issue #41; ``test_combinations.py``) on this file's server.

    In CI's long tier, which runs after the suite on one worker: a ``--tp-size 2`` server keeps both
    cores busy even while idle, and the matrix keeps it up for a minute, which starved the other
    worker's servers in the suite (a 236-token prefill took two minutes; a matrix request timed out)."""
    from test_combinations import check_matrix

    check_matrix("tp", *two_ranks)
