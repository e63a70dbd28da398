"""KVzap and KVzip+ in the real server (issue #57), checked against the HF oracle applying the same rule:
the served keep-set is the one HF's hidden states (KVzap) or HF's reconstruction pass (KVzip+) give,
and the child's answer is the oracle's over that keep-set."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_kvx.policies import get_policy
from sglang_kvx.reference.kvzip import reconstruction_attention
from sglang_kvx.reference.signals import context_signals
from sglang_kvx.select import choose_keep_set
from sglang_kvx.signals import CaptureSpec
from test_compaction_e2e import ask, compact, generate, kvx, overlap, served_keep_set, stored, text

pytestmark = pytest.mark.slow

QUESTION = "Question: which word comes next? Answer:"


def check_child(server, ref, context, keep, policy, keep_fraction, allocation=None):
    """The child reads the served keep-set: tokens and log-probs are the oracle's over it, and differ
    from the full cache's (the check can fail when compaction does nothing)."""
    question = ref.encode(QUESTION)
    params = kvx(policy, keep_fraction, 0, allocation)
    body = generate(server, context + question, 10, sampling=params)
    assert body["meta_info"]["kvx"][0]["child"] is True, body["meta_info"]["kvx"]
    expected_ids, expected_lp = ref.compacted_generate(context, keep, question, 10)
    assert body["output_ids"] == expected_ids
    served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4
    prompt = context + question
    full_lp = ref.prompt_logprobs(prompt + body["output_ids"])[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(served_lp, full_lp)) > 1e-4


@pytest.mark.parametrize("policy", ["kvzap", "kvzap_linear"])
def test_threshold_mode_serves_the_rules_keep_set(compacting, demo_paths, policy):
    """On the dense model and on the hybrid (Qwen3.5's attention layers apply their input norm
    themselves: the tap reads what their qkv_proj reads, as HF's attention module is handed)."""
    name, server, ref = compacting
    context = ref.encode(text(320, seed=5700 + len(policy)))
    n = len(context)
    parent = compact(server, context, policy, 1.0, allocation=None)
    outcome = parent["meta_info"]["kvx"][-1]
    entry = stored(server, n, policy, 1.0)
    assert entry["allocation"] == "threshold"
    served = served_keep_set(server, n, policy, 1.0)
    rule = get_policy(policy)(model_path=demo_paths[name])  # the manifest's tau, window 128
    offline = choose_keep_set(rule, context_signals(ref, context, signals=CaptureSpec(hidden_states=2)), 1.0)
    for got, want in zip(served, offline.positions):
        for g, w in zip(got, want):
            assert abs(len(g) - len(w)) <= 2 and (g[-128:] == torch.arange(n - 128, n)).all()
        assert overlap(got, want) >= 0.99
    kept = sum(len(h) for layer in served for h in layer) / (n * len(served) * len(served[0]))
    assert 0.2 < kept < 0.95  # the threshold dropped something, and kept more than the window
    assert outcome["compacted"] is True and outcome["kept_fraction"] == round(entry["slots"] / n, 6)
    assert abs(outcome["kept_fraction"] - kept) < 0.02  # the folded slots hold what the heads keep
    check_child(server, ref, context, served, policy, 1.0)


def test_budget_mode_keeps_the_fraction_under_one_threshold(compacting_dense, demo_paths):
    server, ref = compacting_dense
    context = ref.encode(text(300, seed=5710))
    n = len(context)
    compact(server, context, "kvzap", 0.3, allocation="global")
    served = served_keep_set(server, n, "kvzap", 0.3)
    assert sum(len(h) for layer in served for h in layer) == 4 * 2 * round(0.3 * n)
    rule = get_policy("kvzap")(model_path=demo_paths["tiny-llama"])
    offline = choose_keep_set(rule, context_signals(ref, context, signals=CaptureSpec(hidden_states=2)), 0.3,
                              allocation="global")
    assert all(overlap(got, want) >= 0.98 for got, want in zip(served, offline.positions))
    check_child(server, ref, context, served, "kvzap", 0.3, allocation="global")


def test_kvzip_plus_passes_score_as_the_hf_reference(compacting_dense):
    """KVzip+ through the server's own passes (||h_j|| recorded by the hidden-state signal, ||W_O^h v_i||
    from the checkpoint's o_proj as Gram matrices) keeps what HF's pass (o_proj applied head by head) keeps."""
    server, ref = compacting_dense
    context = ref.encode(text(220, seed=5720))
    n = len(context)
    compact(server, context, "kvzip_plus", 0.2)
    deadline = time.monotonic() + 120
    while server.stats()["second_passes_pending"] and time.monotonic() < deadline:
        time.sleep(0.2)
    served = served_keep_set(server, n, "kvzip_plus", 0.2)
    signals = context_signals(ref, context)
    signals.reconstruction_attention = reconstruction_attention(ref, context, plus=True)
    offline = choose_keep_set(get_policy("kvzip_plus")(), signals, 0.2)
    for got, want in zip(served, offline.positions):
        assert all(abs(len(g) - len(w)) <= 2 for g, w in zip(got, want))
        assert overlap(got, want) >= 0.95
    assert sum(len(h) for layer in served for h in layer) == sum(map(sum, offline.kept_per_head))
    check_child(server, ref, context, served, "kvzip_plus", 0.2)


@pytest.mark.parametrize("step", ["kvzap", "kvzap_linear"])
def test_decode_step_is_the_oracles_rule_and_gives_slots_back(compacting_dense, demo_paths, step):
    """Each token scored when written, decided once when it leaves the window, dropped entries masked per
    (layer, KV head): tokens and log-probs equal the HF oracle applying the same rule step by step, and
    the dropped entries are the rule's. The row's own decided stretch was re-folded (each head's kept
    entries into ceil(kept / (L * H)) fresh slots) and its own slots went back to the pool while it ran."""
    from sglang_kvx.decode.kvzap import FOLD_EVERY, surrogate_for
    from sglang_kvx.reference.kvzap import kvzap_generate

    server, ref = compacting_dense
    prompt = ref.encode(text(40, seed=5730 + len(step)))
    window, steps = 32, 200
    surrogate = surrogate_for(demo_paths["tiny-llama"], "mlp" if step == "kvzap" else "linear")
    threshold = surrogate.manifest["threshold"]
    body = generate(server, prompt, steps, sampling={"custom_params": {"kvx": {"decode": {"step": step, "window": window}}}})
    tokens, logprobs, rule = kvzap_generate(ref, prompt, steps, surrogate, threshold, window)
    assert body["output_ids"] == tokens
    served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served_lp, logprobs)) <= 1e-4
    full_lp = ref.prompt_logprobs(prompt + tokens)[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(served_lp, full_lp)) > 1e-4  # the drops changed what the model read
    report = [e for e in body["meta_info"]["kvx"] if e.get("decode") == step][-1]
    dropped = sum(int(d.sum()) for d in rule["dropped"])
    assert report["dropped_entries"] == dropped > 0 and report["threshold"] == threshold
    # The fold: the own stretch [start, end) of decided positions, re-folded every FOLD_EVERY of them.
    start, end = report["folded"]
    decided = rule["dropped"][0].shape[1] + 1 - window  # the last step read seq_len keys; < seq_len - window decided
    assert start <= len(prompt) and end == start + FOLD_EVERY * ((decided - start) // FOLD_EVERY) and end > start
    kept = sum(int((~d[:, start:end]).sum()) for d in rule["dropped"])
    cells = len(rule["dropped"]) * rule["dropped"][0].shape[0]
    assert report["fold_slots"] == -(-kept // cells)
    every = torch.stack([d.all(dim=0) for d in rule["dropped"]]).all(dim=0)  # positions no layer or head kept
    assert report["own_slots_given_back"] == (end - start) + int(every[end:decided].sum())
    assert report["slots_freed"] == report["own_slots_given_back"] - report["fold_slots"] > 0
    assert server.stats()["kvzap_slots_freed"] >= report["slots_freed"]


def test_a_model_without_a_surrogate_refuses_kvzap_by_name(server_pool, tiny_qwen3):
    """Per request, on a server whose checkpoint has no KVzap surrogate (tiny-qwen3, built for the suite:
    none is trained for it; test_qwen3_dense's server): a 4xx naming what is missing and the command that
    trains it, for the policy and the decode step; the server goes on."""
    from sglang_kvx.reference.hf import HFReference
    from test_qwen3_dense import qwen3_spec

    server = server_pool.get(qwen3_spec(tiny_qwen3))
    context = HFReference(tiny_qwen3).encode(text(60, seed=5740))
    for kvx_fields, max_new in (({"policy": "kvzap", "keep_fraction": 1.0}, 0), ({"decode": {"step": "kvzap_linear"}}, 4)):
        response = server.generate({"input_ids": context, "sampling_params": {
            "max_new_tokens": max_new, "custom_params": {"kvx": kvx_fields}}})
        assert 400 <= response.status_code < 500, response.text
        assert "surrogate was trained for" in response.text and "train_kvzap --model" in response.text, response.text
    assert generate(server, context, 4)["output_ids"]  # still serving
