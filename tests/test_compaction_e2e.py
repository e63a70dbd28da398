"""Physical compaction in the real server, checked against the HF oracle applying the same keep-set.

The shared compacting server per demo model (``compacting`` in conftest); each case compacts its
own context, with the policy and budget chosen per request (custom_params), so every policy is
checked on one server.
"""

from __future__ import annotations

import random
import time

import pytest
import requests
import torch

from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.policies import get_policy
from sglang_kvx.select import choose_keep_set

pytestmark = pytest.mark.slow

SERVED = ["random", "knorm", "streamingllm", "keydiff", "snapkv", "h2o", "pyramidkv", "triattention", "kvzip", "gatesight"]
HYBRID_ONLY = {"gatesight"}  # reads GDN signals and output gates
HYBRID = {"tiny-hybrid", "tiny-hybrid-deep"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n"


def kvx(policy: str, keep_fraction: float, protected: int = 0, allocation: str | None = None) -> dict:
    params = {"policy": policy, "keep_fraction": keep_fraction, "protected_prefix_len": protected}
    return {"custom_params": {"kvx": params if allocation is None else {**params, "allocation": allocation}}}


def generate(server, input_ids, max_new_tokens, **extra) -> dict:
    response = server.generate(
        {"input_ids": input_ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens, **extra.pop("sampling", {})},
         "return_logprob": True, **extra}
    )
    assert response.status_code == 200, response.text
    return response.json()


def compact(server, context, policy, keep_fraction, protected=0, allocation=None) -> dict:
    body = generate(server, context, 0, sampling=kvx(policy, keep_fraction, protected, allocation))
    if policy == "kvzip":  # compacted once its reconstruction passes (internal requests) are done
        deadline = time.monotonic() + 120
        while server.stats()["second_passes_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
    return body


def offline_keep_set(oracle, ref, path, context, policy, keep_fraction, protected):
    """The offline pipeline on HF: signals of one prefill (plus KVzip's second pass), score, allocate,
    select; the HF passes come from the session's ``oracle`` (shared by every case on this context)."""
    signals = oracle.signals(ref, context, protected_prefix_len=protected)
    if policy == "kvzip":
        signals.reconstruction_attention = oracle.reconstruction(ref, context, protected_prefix_len=protected)
    options = {"model_path": path} if policy == "gatesight" else {}
    return choose_keep_set(get_policy(policy)(**options), signals, keep_fraction)


def ask(server, context, question, policy, keep_fraction, protected=0, max_new_tokens=10) -> dict:
    return generate(server, context + question, max_new_tokens, sampling=kvx(policy, keep_fraction, protected))


def wait_idle(server, total: int, timeout: float = 120.0) -> dict:
    """Stats once no request holds KV (the client-aborted one is cancelled by the server)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        held = stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"] + stats["store_slots"]
        if held == total or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def served_keep_set(server, n: int, policy: str, keep_fraction: float) -> list[torch.Tensor | list[torch.Tensor]]:
    """Per layer [kv_heads, K_l]; a layer whose heads keep different counts (per-head budgets): one tensor per head."""
    entries = requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
    match = [e for e in entries if e["context_tokens"] == n and e["policy"] == policy and e["keep_fraction"] == keep_fraction]
    assert len(match) == 1
    return [torch.tensor(layer) if len({len(h) for h in layer}) == 1 else [torch.tensor(h) for h in layer]
            for layer in match[0]["positions"]]


def overlap(a, b) -> float:
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / sum(len(y) for y in b)


def stored(server, n: int, policy: str, keep_fraction: float) -> dict:
    matches = [c for c in server.stats()["compacted_contexts"]
               if c["context_tokens"] == n and c["policy"] == policy and c["keep_fraction"] == keep_fraction]
    assert len(matches) == 1, server.stats()
    return matches[0]


@pytest.mark.parametrize("keep_fraction", [0.5, 0.1])
@pytest.mark.parametrize("policy", SERVED)
def test_child_matches_the_oracle_with_the_same_keep_set(compacting, policy, keep_fraction, demo_paths, oracle):
    """Every policy on the same context per model and p (the oracle's passes over it are shared)."""
    name, server, ref = compacting
    seed = 1000 + round(100 * keep_fraction)  # the same context on every run
    context = ref.encode(text(220, seed))
    question = ref.encode("Question: which word comes next? Answer:")
    protected = 8
    if policy in HYBRID_ONLY and name not in HYBRID:
        # A dense model has no GDN signals: the request is refused, clearly, and nothing is stored.
        response = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **kvx(policy, keep_fraction)}})
        assert response.status_code == 400 and "needs gdn, output_gate" in response.text, response.text
        assert not [c for c in server.stats()["compacted_contexts"] if c["policy"] == policy]
        return
    compact(server, context, policy, keep_fraction, protected)
    entry = stored(server, len(context), policy, keep_fraction)
    served_keep = served_keep_set(server, len(context), policy, keep_fraction)
    offline = offline_keep_set(oracle, ref, demo_paths[name], context, policy, keep_fraction, protected)
    assert entry["kept_entries"] == offline.kept_per_layer
    # The server scored the same entries as the offline pipeline on HF's keys (up to float ties:
    # q/k-normed keys have near-equal norms, so knorm may swap a few).
    for served, expected in zip(served_keep, offline.positions):
        assert [len(h) for h in served] == [len(h) for h in expected]  # per KV head (KVzip's heads differ)
        assert (served == expected).all() if policy in ("random", "streamingllm") else overlap(served, expected) >= 0.9
        assert all((h[:protected] == torch.arange(protected)).all() for h in served)  # the protected prefix is kept

    body = ask(server, context, question, policy, keep_fraction, protected)
    expected_ids, expected_lp = ref.compacted_generate(context, served_keep, question, 10)
    assert body["output_ids"] == expected_ids, f"{name} {policy} p={keep_fraction}"
    served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4
    # The child read the compacted prefix: its rank slots, as many as the mean of the per-layer (per-head,
    # for KVzip) counts -- layers and heads folded; SGLang's cached tokens are the context it did not prefill.
    kept = offline.kept_per_head
    assert body["meta_info"]["kvx"][-1]["slots"] == -(-sum(map(sum, kept)) // (len(kept) * len(kept[0])))
    assert body["meta_info"]["cached_tokens"] == len(context)
    if policy == "kvzip":  # its heads keep different counts: the per-head layout was exercised
        assert offline.per_head
    # ... and compaction changed what the model saw (the check can fail when it does nothing).
    prompt = context + question
    full_lp = ref.prompt_logprobs(prompt + body["output_ids"])[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(served_lp, full_lp)) > 1e-4


def test_a_childs_prompt_logprobs_come_from_the_cache_that_can_give_them(compacting):
    """A child asking for its prompt's log-probabilities: from its own tokens on (logprob_start_len at or
    past the context), it stays a child and they are the compacted cache's (HF oracle, same keep-set);
    from inside the context, they need the whole cache: it is served by a full prefill, as on a plain
    server. Asking for them inside the compacted prefix used to kill the scheduler (SGLang's logprob
    bookkeeping assert)."""
    name, server, ref = compacting
    context = ref.encode(text(200, seed=77))
    question = ref.encode("Question: which word comes next after these words? Answer:")
    n, prompt = len(context), context + question
    compact(server, context, "keydiff", 0.5)
    keep = served_keep_set(server, n, "keydiff", 0.5)
    inside = generate(server, prompt, 2, sampling=kvx("keydiff", 0.5), logprob_start_len=5)
    (outcome,) = inside["meta_info"]["kvx"]
    assert outcome["child"] is False and "served with the full cache" in outcome["reason"], outcome
    served = [e[0] for e in inside["meta_info"]["input_token_logprobs"][1:]]
    expected = ref.prompt_logprobs(prompt)[5:]
    assert len(served) == len(expected) and max(abs(a - b) for a, b in zip(served, expected)) <= 1e-4
    for start in (n, n + 3):
        child = generate(server, prompt, 2, sampling=kvx("keydiff", 0.5), logprob_start_len=start)
        assert child["meta_info"]["kvx"][0]["child"] is True
        entries = child["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:]  # the true tokens, not the placeholders
        served = [e[0] for e in entries[1:]]
        expected = ref.compacted_prompt_logprobs(context, keep, question)[start - n :]
        assert len(served) == len(expected) and max(abs(a - b) for a, b in zip(served, expected)) <= 1e-4
    # ... and compaction is what they read (the check can fail when it does nothing).
    assert max(abs(a - b) for a, b in zip(expected, ref.prompt_logprobs(prompt)[n + 3 :])) > 1e-4


@pytest.mark.parametrize("policy", ["knorm", "streamingllm", "triattention", "kvzip", "gatesight"])
def test_keep_fraction_one_reproduces_the_uncompacted_answer(compacting, policy):
    name, server, ref = compacting
    if policy in HYBRID_ONLY and name not in HYBRID:
        pytest.skip(f"{policy} is refused on a dense model (test_child_matches_the_oracle_with_the_same_keep_set checks the 400)")
    context = ref.encode(text(150, seed=7))
    question = ref.encode("Question: what was said? Answer:")
    compact(server, context, policy, 1.0)
    body = ask(server, context, question, policy, 1.0)
    assert body["output_ids"] == ref.greedy(context + question, 10), name
    assert stored(server, len(context), policy, 1.0)["reuse_count"] == 1


def test_children_are_token_identical_to_a_fresh_run(compacting):
    """Several children of one parent each answer exactly as a fresh context + compaction + question would."""
    name, server, ref = compacting
    context = ref.encode(text(200, seed=11))
    questions = [ref.encode(f"Question {i}: what is the {w} number? Answer:") for i, w in enumerate(["red", "blue", "green"])]
    compact(server, context, "keydiff", 0.25)
    reused = [ask(server, context, q, "keydiff", 0.25)["output_ids"] for q in questions]
    assert stored(server, len(context), "keydiff", 0.25)["reuse_count"] == 3
    server.flush()
    assert server.stats()["compacted_contexts"] == []
    for question, expected in zip(reversed(questions), reversed(reused)):
        compact(server, context, "keydiff", 0.25)
        assert ask(server, context, question, "keydiff", 0.25)["output_ids"] == expected
        server.flush()


def test_compaction_frees_the_context_and_nothing_leaks(compacting):
    name, server, ref = compacting
    server.flush()
    start = server.stats()
    total = start["kv_pool_total_tokens"]
    assert start["kv_pool_free_tokens"] == total and start["store_slots"] == 0

    context = ref.encode(text(400, seed=21))
    compact(server, context, "streamingllm", 0.1)
    after = server.stats()
    k_max = stored(server, len(context), "streamingllm", 0.1)["slots"]
    assert k_max == round(0.1 * len(context))
    # Only the kept rank slots stay allocated: every other slot of the context went back to the pool.
    assert after["kv_pool_free_tokens"] == total - k_max, after
    assert after["kv_bytes_used"] == k_max * (after["kv_bytes_total"] // total)

    # A mix: children, plain requests, a refused request, an aborted-by-client one.
    for i in range(3):
        ask(server, context, ref.encode(f" question {i}?"), "streamingllm", 0.1)
    generate(server, ref.encode(text(50, seed=22)), 5)
    # Per-layer budgets (PyramidKV): the layers are folded, so the context holds the mean of the
    # per-layer counts and frees (1 - p) of its entries to within one slot. (PyramidKV's reference
    # budgets are flat unless the last layer keeps its 64-token window: half the context here.)
    pyramid = ref.encode(text(300, seed=25))
    before = server.stats()["kv_pool_free_tokens"]
    compact(server, pyramid, "pyramidkv", 0.5)
    entry = stored(server, len(pyramid), "pyramidkv", 0.5)
    kept = entry["kept_entries"]
    assert len(set(kept)) > 1 and entry["folded_entries"] > 0, entry
    assert entry["slots"] == -(-sum(kept) // len(kept)) and before - server.stats()["kv_pool_free_tokens"] == entry["slots"]
    ask(server, pyramid, ref.encode(" which word?"), "pyramidkv", 0.5)
    second = ref.encode(text(120, seed=24))  # KVzip: held context + internal reconstruction passes
    compact(server, second, "kvzip", 0.2)
    ask(server, second, ref.encode(" and?"), "kvzip", 0.2)
    assert server.stats()["second_passes_pending"] == 0
    bad = server.generate({"input_ids": ref.encode(text(3000, seed=23)), "sampling_params": {"max_new_tokens": 4}})
    assert bad.status_code == 400
    with pytest.raises(requests.Timeout):
        server.generate({"input_ids": context + ref.encode(" long answer?"),
                         "sampling_params": {**GREEDY, "max_new_tokens": 2000, **kvx("streamingllm", 0.1)}}, timeout=0.5)
    settled = wait_idle(server, total)  # SGLang's idle leak check runs now, counting the store like a session
    assert settled["kv_pool_free_tokens"] + settled["kv_pool_evictable_tokens"] + settled["store_slots"] == total, settled
    server.flush()
    end = server.stats()
    assert end["kv_pool_free_tokens"] == total and end["store_slots"] == 0 and end["compacted_contexts"] == []


def test_bad_compaction_requests_get_a_clear_error_and_the_server_keeps_serving(compacting):
    name, server, ref = compacting
    context = ref.encode(text(40, seed=31))
    cases = [
        (kvx("knorm", 0.5, protected=len(context) + 5), "protected prefix"),
        (kvx("knorm", 1.5), "(0, 1]"),
        (kvx("snapkvv", 0.5), "valid choices"),
    ]
    if name not in HYBRID:  # no output gates to split budgets by
        cases.append((kvx("keydiff", 0.5, allocation="gate"), "needs output_gate"))
    for params, message in cases:
        response = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **params}})
        assert response.status_code == 400, response.text
        assert message in response.text, response.text
    assert generate(server, ref.encode(text(20, seed=32)), 4)["meta_info"]["completion_tokens"] == 4


def test_idle_compacted_contexts_are_evicted_when_the_pool_fills(compacting):
    """The store never starves SGLang: least recently used idle contexts go when a request needs room."""
    name, server, ref = compacting
    server.flush()
    start = server.stats()
    total = start["kv_pool_total_tokens"]
    contexts = [ref.encode(text(500, seed=100 + i)) for i in range(12)]  # 12 x ~900 slots > the pool
    for context in contexts:
        compact(server, context, "knorm", 0.9)  # would hang if the store could not give way
    stats = server.stats()
    assert stats["contexts_evicted"] > start["contexts_evicted"] and stats["store_slots"] <= total
    # The oldest context was evicted: its child is served as a plain request, from the full prefill.
    question = ref.encode(" what now?")
    body = ask(server, contexts[0], question, "knorm", 0.9, max_new_tokens=6)
    assert body["output_ids"] == ref.greedy(contexts[0] + question, 6)
    settled = wait_idle(server, total)
    assert settled["kv_pool_free_tokens"] + settled["kv_pool_evictable_tokens"] + settled["store_slots"] == total


def test_one_tenant_cannot_evict_another_tenants_reserved_context(compacting):
    """Fair memory: tenant b's context, within b's share of the store's reserve (0.25 of the pool,
    split over the tenants holding contexts), outlives a flood of tenant a's parents and a request
    asking for a very long generation; a's own contexts make way, oldest first."""
    name, server, ref = compacting
    server.flush()
    start = server.stats()
    total = start["kv_pool_total_tokens"]

    def tagged(tenant, policy="knorm", keep_fraction=0.9):
        return {"custom_params": {"kvx": {"policy": policy, "keep_fraction": keep_fraction, "tenant": tenant}}}

    b_context = ref.encode(text(300, seed=300))
    question = ref.encode(" what now?")
    generate(server, b_context, 0, sampling=tagged("b"))
    before = generate(server, b_context + question, 6, sampling=tagged("b"))
    assert before["meta_info"]["kvx"][-1]["child"] is True
    a_contexts = [ref.encode(text(500, seed=310 + i)) for i in range(12)]  # 12 x ~900 slots > the pool
    for context in a_contexts:
        generate(server, context, 0, sampling=tagged("a"))
    with pytest.raises(requests.Timeout):  # an untagged request that could reserve half the pool
        server.generate({"input_ids": ref.encode(" go"), "sampling_params": {**GREEDY, "max_new_tokens": 4000}},
                        timeout=1.0)
    stats = wait_idle(server, total)
    tenants = [c["tenant"] for c in stats["compacted_contexts"]]
    assert stats["contexts_evicted"] > start["contexts_evicted"] and tenants.count("b") == 1, tenants
    assert stats["store_reserved_slots"] >= stored(server, len(b_context), "knorm", 0.9)["slots"]
    after = generate(server, b_context + question, 6, sampling=tagged("b"))
    assert after["meta_info"]["kvx"][-1]["child"] is True and after["output_ids"] == before["output_ids"]
    # a's oldest context went first: its child is served from the full prefill, as the oracle says.
    body = generate(server, a_contexts[0] + question, 6, sampling=tagged("a"))
    assert "kvx" not in body["meta_info"] or not body["meta_info"]["kvx"]
    assert body["output_ids"] == ref.greedy(a_contexts[0] + question, 6)


def disk_settled(server, timeout: float = 60.0, **expect) -> dict:
    """The server's /kvx/stats once its disk tier's worker has nothing queued (writes, reads) and every
    ``expect``ed count holds (e.g. ``disk_contexts=1``: files another server or the test wrote are
    found by the worker's scan); the disk tier's I/O runs off the scheduler thread, so a file written
    or put back is seen a moment later, not at once."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if (not stats.get("disk_writes_queued") and not stats.get("disk_reads_queued")
                and all(stats.get(key) == value for key, value in expect.items())):
            return stats
        assert time.monotonic() < deadline, {key: stats.get(key) for key in ("disk_writes_queued", "disk_reads_queued", *expect)}
        time.sleep(0.05)


def scrape(server) -> dict[str, float]:
    """sglang:kvx_* samples of SGLang's /metrics (labels dropped: one scheduler here)."""
    found: dict[str, float] = {}
    for line in requests.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:kvx_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            found[name] = found.get(name, 0.0) + value
    return found


def test_the_extensions_figures_are_on_sglangs_prometheus_endpoint(compacting):
    name, server, ref = compacting
    server.flush()
    before = scrape(server)
    context = ref.encode(text(200, seed=91))
    compact(server, context, "knorm", 0.5)
    ask(server, context, ref.encode(" and?"), "knorm", 0.5, max_new_tokens=3)
    stats, after = server.stats(), scrape(server)
    assert after["sglang:kvx_compacted_contexts"] == len(stats["compacted_contexts"]) == 1
    assert after["sglang:kvx_store_slots"] == stats["store_slots"] == stored(server, len(context), "knorm", 0.5)["slots"]
    assert after["sglang:kvx_compactions_total"] - before.get("sglang:kvx_compactions_total", 0) == 1
    assert after["sglang:kvx_bytes_freed_total"] == stats["bytes_freed"] > 0
    assert after["sglang:kvx_scoring_seconds_count"] - before.get("sglang:kvx_scoring_seconds_count", 0) == 1
    assert after["sglang:kvx_second_passes_pending"] == 0 and "sglang:kvx_contexts_evicted_total" in after
    server.flush()
    assert scrape(server)["sglang:kvx_compacted_contexts"] == 0


def test_a_full_cache_request_never_adopts_a_compacted_context(compacting):
    name, server, ref = compacting
    context = ref.encode(text(150, seed=41))
    question = ref.encode(" and then?")
    compact(server, context, "keydiff", 0.5)  # the server's default settings: KeyDiff, p = 0.5
    full = generate(server, context + question, 6, sampling={"custom_params": {"kvx": {"compact": False}}})
    assert full["output_ids"] == ref.greedy(context + question, 6)
    assert stored(server, len(context), "keydiff", 0.5)["reuse_count"] == 0
    child = generate(server, context + question, 6)  # no settings: the server's, so it is a child
    assert child["meta_info"]["kvx"][-1]["slots"] == stored(server, len(context), "keydiff", 0.5)["slots"]


def test_gdn_signals_recomputed_from_the_layer_inputs_match(recomputing_hybrid, demo_paths, oracle):
    """The route SGLang's own GDN kernels take (signals recomputed around RadixLinearAttention,
    not handed over by our CPU backend) yields the same GateSight keep-set as the offline pipeline,
    the prefill in chunks of 128 tokens (the conv state carries over)."""
    server, ref = recomputing_hybrid
    context = ref.encode(text(300, seed=5))
    compact(server, context, "gatesight", 0.2, protected=4)
    served = served_keep_set(server, len(context), "gatesight", 0.2)
    offline = offline_keep_set(oracle, ref, demo_paths["tiny-hybrid-deep"], context, "gatesight", 0.2, 4)
    assert [s.shape[1] for s in served] == offline.kept_per_layer
    for got, expected in zip(served, offline.positions):
        assert overlap(got, expected) >= 0.9


@pytest.mark.parametrize("pattern", ["cached_first_half", "two_turns"])
def test_a_parent_sees_its_whole_context_whatever_the_prefix_cache_holds(compacting, demo_paths, pattern, oracle):
    """A policy reading signals recorded inside the prefill (GateSight's GDN signals and gates,
    SnapKV's window queries) must see all n tokens even when the prefix cache already holds some."""
    name, server, ref = compacting
    policy = "gatesight" if name in HYBRID else "snapkv"
    seed = 61 if pattern == "cached_first_half" else 62
    context = ref.encode(text(240, seed=seed))
    if pattern == "cached_first_half":
        generate(server, context[: len(context) // 2], 2)  # an earlier request: now in the radix cache
    else:
        first_turn = context[: len(context) // 2]
        answer = generate(server, first_turn, 4)["output_ids"]
        context = first_turn + answer + ref.encode(" and then? ") + context[len(context) // 2 :]
    compact(server, context, policy, 0.2, protected=4)
    entry = stored(server, len(context), policy, 0.2)
    stats = server.stats()
    assert "signals of shape" not in str(stats["last_compaction_error"])
    offline = offline_keep_set(oracle, ref, demo_paths[name], context, policy, 0.2, 4)
    assert entry["kept_entries"] == offline.kept_per_layer
    served_keep = served_keep_set(server, len(context), policy, 0.2)
    for served, expected in zip(served_keep, offline.positions):
        assert overlap(served, expected) >= 0.9
    question = ref.encode("Question: which word comes next? Answer:")
    body = ask(server, context, question, policy, 0.2, protected=4)
    expected_ids, _ = ref.compacted_generate(context, served_keep, question, 10)
    assert body["output_ids"] == expected_ids


def test_each_response_says_what_was_compacted(compacting):
    """meta_info["kvx"]: a parent compacted (and into how many slots) or not and why; a child's prefix."""
    name, server, ref = compacting
    context = ref.encode(text(90, seed=71))

    def kvx_info(body: dict) -> dict | None:
        info = body["meta_info"].get("kvx")
        return info[-1] if info else None

    parent = kvx_info(generate(server, context, 0, sampling=kvx("keydiff", 0.5)))
    assert parent["compacted"] is True and parent["slots"] == stored(server, len(context), "keydiff", 0.5)["slots"]
    child = kvx_info(ask(server, context, ref.encode(" what?"), "keydiff", 0.5, max_new_tokens=2))
    assert child["child"] is True and child["slots"] == parent["slots"] and child["context_tokens"] == len(context)
    assert kvx_info(generate(server, ref.encode(text(10, seed=72)), 2)) is None  # plain: nothing to say
    # Degenerate contexts are served uncompacted, and the response says why; nothing is stored.
    one = kvx_info(generate(server, context[:1], 0, sampling=kvx("keydiff", 0.5)))
    assert one["compacted"] is False and "too short" in one["reason"]
    tiny = ref.encode(text(30, seed=73))
    none_kept = kvx_info(generate(server, tiny, 0, sampling=kvx("keydiff", 0.001)))
    assert none_kept["compacted"] is False and "keeps no entry" in none_kept["reason"]
    assert not [c for c in server.stats()["compacted_contexts"] if c["context_tokens"] in (1, len(tiny))]


def test_parallel_sampling_leaves_no_unrequested_context(compacting):
    """n > 1: SGLang warms the prompt up with a prefill-only copy; that copy is no parent."""
    name, server, ref = compacting
    prompt = ref.encode(text(70, seed=74))
    body = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0.8}})
    assert body.status_code == 200 and len(body.json()) == 2, body.text
    assert not [c for c in server.stats()["compacted_contexts"] if c["context_tokens"] == len(prompt)]
    compact(server, prompt, "knorm", 0.5)  # the same prompt sent as a context is compacted as usual
    assert stored(server, len(prompt), "knorm", 0.5)["slots"] > 0


def test_a_kvzip_child_sent_before_the_passes_end_waits_for_them(shared_server, references):
    """A child of a context whose reconstruction passes still run stays queued until they end, then
    reads the compacted context: the same tokens as the child sent once the passes are done (before,
    it read the full cache, so its tokens depended on timing). On the chunked-prefill server the
    passes take several scheduler rounds, so a child sent on the parent's answer arrives while they
    run; its response says how long it waited."""
    server, ref = shared_server("chunked", "tiny-llama"), references["tiny-llama"]
    question = ref.encode("Question: which word comes next? Answer:")
    waited = None
    for attempt in range(3):  # a fast machine may finish the passes before the child arrives: again
        context = ref.encode(text(900, seed=46 + attempt))
        before = server.stats()["children_waited_for_second_passes"]
        parent = generate(server, context, 0, sampling=kvx("kvzip", 0.2))
        assert parent["meta_info"]["kvx"][0].get("pending"), parent["meta_info"]
        early = ask(server, context, question, "kvzip", 0.2)
        outcome = early["meta_info"]["kvx"][0]
        assert outcome["child"] is True, early["meta_info"]
        if "waited_for_second_passes_s" in outcome:
            assert server.stats()["children_waited_for_second_passes"] == before + 1
            waited = (context, early)
            break
    assert waited is not None, "no child arrived while its context's passes ran, in 3 tries"
    context, early = waited
    late = ask(server, context, question, "kvzip", 0.2)
    assert "waited_for_second_passes_s" not in late["meta_info"]["kvx"][0]
    assert early["output_ids"] == late["output_ids"]
    assert early["meta_info"]["kvx"][0]["slots"] == late["meta_info"]["kvx"][0]["slots"] < len(context)
