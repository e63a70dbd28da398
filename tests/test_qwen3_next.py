"""Qwen3-Next (grouped GDN projections, MoE in every layer, partial RoPE) serves on the CPU platform,
matches HF, and compacts with GateSight: its output gates and GDN signals are captured inside
SGLang's own Qwen3-Next forward and give the same budgets and keep-sets as the HF pipeline."""

from __future__ import annotations

import pytest

from sglang_kvx.models.demo import build_demo_model
from sglang_kvx.policies import get_policy
from sglang_kvx.reference.hf import HFReference
from sglang_kvx.reference.signals import context_signals
from sglang_kvx.select import choose_keep_set
from server_pool import spec
from test_compaction_e2e import compact, generate, kvx, overlap, served_keep_set, stored, text
from test_qwen3_dense import assert_serves_like_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_next_model(tmp_path_factory):
    """A tiny Qwen3-Next, toy GateSight estimators trained for it, and its HF reference."""
    from sglang_kvx.training.train_gatesight import main as train

    root = tmp_path_factory.mktemp("qwen3-next")
    path = build_demo_model("tiny-qwen3-next", root / "tiny-qwen3-next")
    estimator = root / "estimator"
    train(["--model", str(path), "--out", str(estimator), "--train-docs", "3", "--heldout-docs", "1",
           "--lengths", "512", "--questions", "1", "--epochs", "2", "--tasks", "niah_single_1,vt"])
    return path, estimator, HFReference(path)


def qwen3_next_spec(path, estimator, *args: str, env: dict[str, str] | None = None):
    return spec(path, "--kvx-policy", "gatesight", "--kvx-keep-fraction", "0.2", "--kvx-estimator", str(estimator),
                "--context-length", "4096", *args, max_total_tokens=8192, env=env)


@pytest.fixture
def qwen3_next(qwen3_next_model, server_pool):
    path, estimator, ref = qwen3_next_model
    return path, estimator, server_pool.get(qwen3_next_spec(path, estimator)), ref


def test_full_cache_matches_hf(qwen3_next):
    _, _, server, ref = qwen3_next
    assert_serves_like_hf(server, ref)


@pytest.mark.parametrize("policy,allocation", [("gatesight", "gate"), ("keydiff", "gate")])
def test_compacted_child_matches_the_oracle(qwen3_next, policy, allocation):
    """Gate budgets come from the output gates captured in SGLang's forward: equal per-layer counts
    to HF's pipeline prove the capture; the child's tokens equal HF applying the served keep-set."""
    path, estimator, server, ref = qwen3_next
    keep_fraction, protected = 0.2, 4
    context = ref.encode(text(260, seed=11 if policy == "gatesight" else 12))
    question = ref.encode("Question: which word comes next? Answer:")
    compact(server, context, policy, keep_fraction, protected, allocation)
    entry = stored(server, len(context), policy, keep_fraction)
    options = {"estimator": estimator, "model_path": path} if policy == "gatesight" else {}
    signals = context_signals(ref, context, protected_prefix_len=protected)
    offline = choose_keep_set(get_policy(policy)(**options), signals, keep_fraction, allocation)
    assert entry["kept_entries"] == offline.kept_per_layer
    assert len(set(offline.kept_per_layer)) > 1  # gate budgets: the two attention layers differ
    served = served_keep_set(server, len(context), policy, keep_fraction)
    for got, expected in zip(served, offline.positions):
        assert overlap(got, expected) >= 0.9
    body = generate(server, context + question, 10, sampling=kvx(policy, keep_fraction, protected, allocation))
    expected_ids, expected_lp = ref.compacted_generate(context, served, question, 10)
    assert body["output_ids"] == expected_ids
    served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4


def test_gdn_signals_recomputed_on_the_gpu_route_match(qwen3_next_model, server_pool):
    """SGLang's own GDN kernels (GPU) hand nothing over: the signals are recomputed from
    Qwen3-Next's grouped-projection inputs around RadixLinearAttention, and give the same keep-set."""
    path, estimator, ref = qwen3_next_model
    server = server_pool.get(qwen3_next_spec(path, estimator, "--chunked-prefill-size", "128",
                                             env={"SGLANG_KVX_GDN_SIGNALS": "recompute"}))
    context = ref.encode(text(300, seed=5))
    compact(server, context, "gatesight", 0.2, protected=4, allocation="gate")  # the recomputed gates too
    served = served_keep_set(server, len(context), "gatesight", 0.2)
    policy = get_policy("gatesight")(estimator=estimator, model_path=path)
    offline = choose_keep_set(policy, context_signals(ref, context, protected_prefix_len=4), 0.2, "gate")
    assert [s.shape[1] for s in served] == offline.kept_per_layer
    for got, expected in zip(served, offline.positions):
        assert overlap(got, expected) >= 0.9
