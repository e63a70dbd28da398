"""One file registers a policy; the real server serves it end to end, as the HF oracle says it must."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_compaction_e2e import ask, compact, served_keep_set, stored, text, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.quick]  # the shared dense server's


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
