"""One file registers a policy; the real server serves it end to end, as the HF oracle says it must."""

from __future__ import annotations

import contextlib
import importlib
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_compaction_e2e import ask, compact, overlap, served_keep_set, stored, text, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.quick]  # the shared dense server's


@contextlib.contextmanager
def throwaway_registered():
    """``throwaway_policy`` registered in this process for the block only: other tests see the
    package's registries as shipped."""
    from sglang_kvx.decode.base import DECODE_STEPS
    from sglang_kvx.policies.base import POLICIES
    from sglang_kvx.signals.base import SIGNAL_FIELDS, SIGNALS

    registries = (DECODE_STEPS, POLICIES, SIGNALS, SIGNAL_FIELDS)
    saved = [registry.copy() for registry in registries]
    try:
        importlib.import_module("throwaway_policy")
        yield
    finally:
        sys.modules.pop("throwaway_policy", None)
        for registry, before in zip(registries, saved):
            registry.clear()
            registry.update(before)


def test_a_policy_with_its_own_signal_from_one_file_matches_the_oracle(compacting_dense):
    """``throwaway_policy`` also registers a signal (each key's peak attention, captured chunk by chunk
    inside SGLang's forward) and a policy reading it: served end to end, the keep set is the one the
    HF producer's whole-context reference of that signal gives, and the child equals the HF oracle."""
    from sglang_kvx.policies import get_policy
    from sglang_kvx.reference.signals import context_signals
    from sglang_kvx.select import choose_keep_set
    from sglang_kvx.signals import CaptureSpec

    server, ref = compacting_dense
    context = ref.encode(text(200, seed=44))
    compact(server, context, "_throwaway_peak", 0.3)
    entry = stored(server, len(context), "_throwaway_peak", 0.3)
    with throwaway_registered():  # the oracle reads the same file's signal and policy
        signals = context_signals(ref, context, column_sums=False, queries=False,
                                  signals=CaptureSpec(_throwaway_peak_attention=True))
        offline = choose_keep_set(get_policy("_throwaway_peak")(), signals, 0.3)
    served = served_keep_set(server, len(context), "_throwaway_peak", 0.3)
    assert entry["kept_entries"] == offline.kept_per_layer
    for got, expected in zip(served, offline.positions):
        assert overlap(got, expected) >= 0.9
    h2o = choose_keep_set(get_policy("h2o")(), context_signals(ref, context, queries=False), 0.3)
    assert sum(overlap(a, b) for a, b in zip(offline.positions, h2o.positions)) < len(served)  # its own rule
    question = ref.encode("Question: which word? Answer:")
    body = ask(server, context, question, "_throwaway_peak", 0.3)
    assert body["output_ids"] == ref.compacted_generate(context, served, question, 10)[0]


def test_a_policy_from_one_file_is_served_and_matches_the_oracle(compacting_dense):
    """The shared compacting server imports ``throwaway_policy`` (``--kvx-policy-modules``)."""
    server, ref = compacting_dense
    before = server.stats()
    total = before["kv_pool_total_tokens"]
    context = ref.encode(text(120, seed=41))
    context = context[: len(context) // 2 * 2]  # an even length: half the positions are even
    compact(server, context, "_throwaway_even", 0.5)
    assert stored(server, len(context), "_throwaway_even", 0.5)["kept_entries"] == [len(context) // 2] * 4
    evens = torch.arange(0, len(context), 2)
    for layer in served_keep_set(server, len(context), "_throwaway_even", 0.5):
        assert (layer == evens).all()  # written by hand above, not by the code under test
    question = ref.encode("Question: which word? Answer:")
    body = ask(server, context, question, "_throwaway_even", 0.5)
    keep = [evens.expand(2, -1).clone() for _ in range(4)]
    expected_ids, _ = ref.compacted_generate(context, keep, question, 10)
    assert body["output_ids"] == expected_ids
    assert server.stats()["policy"] == "keydiff"  # the flag's policy; the request chose the throwaway one

    # A policy that raises inside the scheduler: that context stays uncompacted with the reason,
    # and the server goes on serving everyone else exactly as before.
    other = ref.encode(text(80, seed=42))
    compact(server, other, "_throwaway_failing", 0.5)
    stats = server.stats()
    assert stats["compactions_failed"] - before["compactions_failed"] == 1
    assert "planted failure" in stats["last_compaction_error"]
    assert not [c for c in stats["compacted_contexts"] if c["policy"] == "_throwaway_failing"]
    assert ask(server, context, question, "_throwaway_even", 0.5)["output_ids"] == expected_ids
    # ... and one that raises while the request is admitted: that request gets an error.
    refused = server.generate({"input_ids": other, "sampling_params": {"max_new_tokens": 0, "custom_params": {
        "kvx": {"policy": "_throwaway_failing_capture", "keep_fraction": 0.5}}}})
    assert refused.status_code != 200 and "internal error" in refused.text, refused.text
    assert server.stats()["compactions_failed"] - before["compactions_failed"] == 2
    assert ask(server, context, question, "_throwaway_even", 0.5)["output_ids"] == expected_ids
    # A decode step that raises in the forward: its request ends with an error, the batch's other
    # request (sent at the same time) is answered exactly, nothing leaks.
    plain = ref.encode(text(40, seed=43))
    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(server.generate, {"input_ids": plain, "sampling_params": {
            "temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40,
            "custom_params": {"kvx": {"compact": False, "decode": {"step": "_throwaway_failing_step"}}}}})
        fine = pool.submit(ask, server, context, question, "_throwaway_even", 0.5, max_new_tokens=40)
        failed, answered = failing.result(), fine.result()
    body = failed.json() if failed.status_code == 200 else {}
    assert failed.status_code != 200 or body["meta_info"]["finish_reason"]["type"] == "abort", failed.text
    assert "internal error" in failed.text
    assert answered["output_ids"][:10] == expected_ids
    assert server.stats()["decode_step_failures"] - before["decode_step_failures"] == 1
    assert "planted failure" in server.stats()["last_decode_step_error"]
    settled = wait_idle(server, total)
    assert settled["kv_pool_free_tokens"] + settled["kv_pool_evictable_tokens"] + settled["store_slots"] == total
