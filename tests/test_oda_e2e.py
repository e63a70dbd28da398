"""On-Demand Attention on the real server, token for token against the HF oracle applying the same
routing rule step by step (``sglang_kvx.reference.oda``: Local attempt, the head's score, a Full
re-run from the restored pre-step state, commit of the chosen branch).

The shared compacting server of each model (dense tiny-llama, hybrid tiny-hybrid-deep with GDN and
conv states), each serving a recall head with seeded random weights written for the suite
(``seeded_head``): its scores fall on both sides of theta, so a request's steps mix Local and
Full; the oracle runs the same head.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_kvx.config import KvxConfigError, build_config
from sglang_kvx.decode.recall_head import RecallHead, config_hash, load_model_config
from sglang_kvx.reference.oda import always_full, always_local, compacted_route_generate, head_route, oda_generate

from test_compaction_e2e import GREEDY, compact, served_keep_set, stored, text, wait_idle

SINKS, WINDOW, NEW_TOKENS = 2, 16, 20


def seeded_head(model_path: str, name: str, out) -> RecallHead:
    cfg = load_model_config(model_path)
    torch.manual_seed(0)
    head = RecallHead(cfg["hidden_size"])
    for parameter in head.parameters():
        parameter.data.normal_(0, 0.3)  # scores of either sign (a fresh head's last layer is near zero)
    head.save_pretrained(out, {"model": {"name": name, "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"],
                                         "config_hash": config_hash(cfg)}, "sinks": SINKS, "window": WINDOW})
    return RecallHead.from_pretrained(out, model_path)


@pytest.fixture
def oda_server(compacting, seeded_oda_heads, demo_paths):
    """The shared compacting server of each model; it serves the seeded head (conftest: ``seeded_head``)."""
    name, server, ref = compacting
    return name, server, ref, RecallHead.from_pretrained(seeded_oda_heads[name], demo_paths[name])


def oda(**options) -> dict:
    return {"custom_params": {"kvx": {"decode": {"step": "oda", "sinks": SINKS, "window": WINDOW, **options}}}}


def run(server, prompt, max_new_tokens=NEW_TOKENS, **sampling) -> dict:
    response = server.generate({"input_ids": prompt, "return_logprob": True,
                                "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens, **sampling}})
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(body) -> list[float]:
    return [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_routed_decoding_matches_the_oracle_step_for_step(oda_server):
    name, server, ref, head = oda_server
    prompt = ref.encode(text(60, seed=61))
    for theta in (0.0, 0.5):
        body = run(server, prompt, **oda(theta=theta))
        expected = oda_generate(ref, prompt, NEW_TOKENS, SINKS, WINDOW, head_route(head, theta))
        assert body["output_ids"] == expected.tokens
        assert close(logprobs(body), expected.logprobs) <= 1e-4
        report = body["meta_info"]["kvx"][-1]
        assert report["routed_steps"] == NEW_TOKENS - 1 and report["full_steps"] == sum(expected.full_steps)
        assert 0 < report["full_steps"] < report["routed_steps"]  # both branches were taken and committed
        assert report["flops"]["oda_flops"] > 0 and report["flops"]["full_flops"] > 0


@pytest.mark.slow
def test_fixed_schedules_always_local_and_always_full(oda_server):
    """theta above every score: Local at every step (the span oracle); below every score: Full at
    every step, which is plain greedy decoding exactly."""
    name, server, ref, head = oda_server
    prompt = ref.encode(text(60, seed=62))
    local = run(server, prompt, **oda(theta=1e6))
    expected = oda_generate(ref, prompt, NEW_TOKENS, SINKS, WINDOW, always_local)
    assert local["output_ids"] == expected.tokens and close(logprobs(local), expected.logprobs) <= 1e-4
    assert local["meta_info"]["kvx"][-1]["full_steps"] == 0
    full = run(server, prompt, **oda(theta=-1e6))
    plain = run(server, prompt)
    assert full["output_ids"] == plain["output_ids"] == oda_generate(ref, prompt, NEW_TOKENS, SINKS, WINDOW, always_full).tokens
    assert close(logprobs(full), logprobs(plain)) <= 1e-4
    assert full["meta_info"]["kvx"][-1]["full_rate"] == 1.0
    assert local["output_ids"] != plain["output_ids"]  # the window mattered


@pytest.mark.slow
def test_a_mixed_batch_equals_its_requests_run_alone(oda_server):
    """Rows of one batch take different branches: ODA rows at two thetas, a span-schedule row and
    a plain one, sent together, answer exactly as each sent alone; only the rows that chose Full
    are re-run (sub-batches), and nothing leaks."""
    name, server, ref, head = oda_server
    prompts = [ref.encode(text(40 + 15 * i, seed=70 + i)) for i in range(4)]
    kinds = [oda(theta=0.0), oda(theta=0.5, window=8),
             {"custom_params": {"kvx": {"decode": {"step": "span_schedule", "sinks": 2, "window": 8, "full_every": 3}}}}, {}]
    alone = [run(server, p, **k) for p, k in zip(prompts, kinds)]
    stats_before = server.stats()
    before = stats_before["decode_partial_reruns"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda pk: run(server, pk[0], **pk[1]), zip(prompts, kinds)))
    for a, b in zip(alone, together):
        assert a["output_ids"] == b["output_ids"]
        assert close(logprobs(a), logprobs(b)) <= 1e-4
    assert server.stats()["decode_partial_reruns"] > before
    assert together[0]["output_ids"] == oda_generate(ref, prompts[0], NEW_TOKENS, SINKS, WINDOW, head_route(head)).tokens
    total = stats_before["kv_pool_total_tokens"]
    stats = wait_idle(server, total)
    assert stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"] == total
    assert stats["decode_rows"] == 0 and stats["oda_routed_steps"] > stats_before["oda_routed_steps"]


@pytest.mark.slow
def test_bad_oda_options_are_refused_at_the_door(oda_server):
    name, server, ref, head = oda_server
    for options, fragment in [({"theta": "0.5"}, "theta must be a finite number"), ({"theta": True}, "theta"),
                              ({"theta": 1e300}, "theta"), ({"window": 0}, "window must be >= 1"),
                              ({"windw": 3}, "unknown field")]:
        response = server.generate({"input_ids": ref.encode("a b c"), "sampling_params": {
            **GREEDY, "max_new_tokens": 2, **oda(**options)}})
        assert response.status_code == 400 and fragment in response.text, response.text


def test_a_server_without_a_matching_head_refuses_oda(demo_paths, tmp_path):
    with pytest.raises(KvxConfigError, match="needs a recall head"):
        build_config(model_path=demo_paths["tiny-llama"], decode="oda", oda_head="")
    head_dir = tmp_path / "head"
    seeded_head(demo_paths["tiny-hybrid-deep"], "tiny-hybrid-deep", head_dir)
    with pytest.raises(KvxConfigError, match="trained for model 'tiny-hybrid-deep'"):
        build_config(model_path=demo_paths["tiny-llama"], decode="oda", oda_head=str(head_dir))
    with pytest.raises(KvxConfigError, match="--kvx-decode"):
        build_config(model_path=demo_paths["tiny-llama"], decode='{"step": "oda", "theta": "x"}', oda_head=str(head_dir))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["knorm", "pyramidkv"])
def test_oda_over_a_compacted_prefix_matches_the_oracle(oda_server, policy):
    """A child of a compacted context runs ODA too: in each layer Local reads the first sinks and the
    last window of that layer's own keys (its kept entries, then the child's tokens), as the oracle's
    compacted cache holds them; PyramidKV's per-layer budgets put some kept entries in other layers'
    cells (the window then reaches across them)."""
    name, server, ref, head = oda_server
    context = ref.encode(text(300, seed=81))
    question = ref.encode(" what comes next?")
    compact(server, context, policy, 0.5)
    keep = served_keep_set(server, len(context), policy, 0.5)
    if policy == "pyramidkv":  # per-layer budgets: some layers keep entries in other layers' cells
        assert stored(server, len(context), policy, 0.5)["folded_entries"] > 0
    for theta in (0.0, 1e6):
        body = run(server, context + question, **{"custom_params": {"kvx": {"policy": policy, "keep_fraction": 0.5,
                                                 "decode": {"step": "oda", "sinks": SINKS, "window": WINDOW, "theta": theta}}}})
        assert body["meta_info"]["kvx"][0]["child"] is True
        tokens, lps, full = compacted_route_generate(ref, context, keep, question, NEW_TOKENS, SINKS, WINDOW,
                                                     head_route(head, theta))
        assert body["output_ids"] == tokens
        assert close(logprobs(body), lps) <= 1e-4
        assert body["meta_info"]["kvx"][-1]["full_steps"] == sum(full)
    plain_child = run(server, context + question, **{"custom_params": {"kvx": {"policy": policy, "keep_fraction": 0.5}}})
    assert plain_child["output_ids"] != body["output_ids"]  # always-Local over the compacted prefix differs
