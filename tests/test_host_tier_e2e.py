"""Issue #44 item 1 end to end: on a server with a small pool and ``--kvx-host-store-gb``, a compacted
context pushed out of the pool by a long request moves to host memory; its next child is restored
from there (``meta_info["kvx"]["restored_from"] == "host"``) and answers token for token as the same
child did before the eviction and as the HF oracle does with the served keep-set -- on the dense
model and on the hybrid one (its GDN snapshot travels with the context). The same server writes
every compacted context to its ``--kvx-context-dir``: the files put back after ``/flush_cache``
emptied every tier (what a restart finds) are restored from disk, token-identical too. The figures
show on ``/kvx/stats`` and ``/metrics``; ``/flush_cache`` empties the tiers (the shared pool checks
them whole)."""

from __future__ import annotations

import pytest

import shutil

from server_pool import TIERED_DIR, TIERED_POOL
from sglang_kvx.store.context_file import MARKER
from test_compaction_e2e import ask, compact, disk_settled, generate, kvx, scrape, served_keep_set, stored, text

pytestmark = pytest.mark.slow

POLICY, P = "knorm", 0.5


@pytest.fixture(scope="module", params=[pytest.param("tiny-llama", marks=pytest.mark.quick), "tiny-hybrid-deep"])
def tiered_model(request) -> str:
    return request.param


@pytest.fixture
def tiered(tiered_model, shared_server, references):
    """(name, server, reference) on the shared host-tier server of each model."""
    return tiered_model, shared_server("tiered", tiered_model), references[tiered_model]


def push_out_every_context(server, ref, seed: int) -> None:
    """A plain request whose prompt needs nearly the whole pool: every stored context must make way."""
    ids = []
    while len(ids) < TIERED_POOL:
        ids += ref.encode(text(400, seed=seed + len(ids)))
    body = generate(server, ids[: TIERED_POOL - 100], 2)
    assert body["meta_info"]["completion_tokens"] == 2


def child(server, context, question, allocation):
    return generate(server, context + question, 8, sampling=kvx(POLICY, P, allocation=allocation))


# pyramidkv: per-layer budgets, folded -- some layers' ranks sit in other layers' cells, which the
# restore must re-point at the new slots.
@pytest.mark.parametrize("allocation", ["flat", "pyramidkv"])
def test_an_evicted_context_comes_back_from_host_memory_token_identical(tiered, allocation):
    name, server, ref = tiered
    server.flush()
    start, metrics_start = server.stats(), scrape(server)
    context = ref.encode(text(300, seed=4400))
    question = ref.encode(" Question: which word comes next? Answer:")
    compact(server, context, POLICY, P, allocation=allocation)
    in_pool = stored(server, len(context), POLICY, P)
    assert (in_pool["folded_entries"] > 0) == (allocation == "pyramidkv")
    pool_bytes = server.stats()["pool_context_bytes"]
    keep = served_keep_set(server, len(context), POLICY, P)
    before = child(server, context, question, allocation)
    assert before["meta_info"]["kvx"][-1]["child"] is True and "restored_from" not in before["meta_info"]["kvx"][-1]

    push_out_every_context(server, ref, seed=4500)
    evicted = server.stats()
    assert evicted["compacted_contexts"] == [] and evicted["store_slots"] == 0, evicted["compacted_contexts"]
    assert evicted["host_contexts"] == 1 and evicted["host_contexts_stored"] - start["host_contexts_stored"] == 1
    assert evicted["contexts_evicted"] - start["contexts_evicted"] == 1
    # The kept K/V of every attention layer (and, on the hybrid model, its GDN snapshot besides).
    assert evicted["host_bytes"] == pool_bytes if name == "tiny-llama" else evicted["host_bytes"] > pool_bytes
    assert [c["context_tokens"] for c in evicted["host_compacted_contexts"]] == [len(context)]

    after = child(server, context, question, allocation)
    outcome = after["meta_info"]["kvx"][-1]
    assert outcome["child"] is True and outcome["restored_from"] == "host", outcome
    # It read the restored rank slots; SGLang's cached tokens are the context's, which it did not prefill.
    assert outcome["slots"] == in_pool["slots"] and after["meta_info"]["cached_tokens"] == len(context)
    assert after["output_ids"] == before["output_ids"]
    lp_before = [e[0] for e in before["meta_info"]["output_token_logprobs"]]
    lp_after = [e[0] for e in after["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp_before, lp_after)) <= 1e-5
    expected_ids, _ = ref.compacted_generate(context, keep, question, 8)
    assert after["output_ids"] == expected_ids

    restored = server.stats()
    assert restored["host_contexts"] == 0 and restored["host_bytes"] == 0
    assert restored["host_restores"] - start["host_restores"] == 1 and restored["host_restore_seconds"] > start["host_restore_seconds"]
    assert stored(server, len(context), POLICY, P)["slots"] == in_pool["slots"]
    metrics = scrape(server)
    assert metrics["sglang:kvx_host_restores_total"] - metrics_start.get("sglang:kvx_host_restores_total", 0) == 1
    assert metrics["sglang:kvx_host_contexts_stored_total"] - metrics_start.get("sglang:kvx_host_contexts_stored_total", 0) == 1
    assert metrics["sglang:kvx_host_contexts"] == 0 and metrics["sglang:kvx_host_restore_seconds_total"] > 0


def test_flush_cache_empties_the_host_tier(tiered):
    name, server, ref = tiered
    server.flush()
    context = ref.encode(text(300, seed=4600))
    question = ref.encode(" and then?")
    compact(server, context, POLICY, P)
    push_out_every_context(server, ref, seed=4700)
    assert server.stats()["host_contexts"] == 1
    server.flush()
    stats = server.stats()
    assert stats["host_contexts"] == 0 and stats["host_bytes"] == 0 and stats["host_compacted_contexts"] == []
    # Nothing left to restore: the child is served from a full prefill, as the plain model answers.
    body = ask(server, context, question, POLICY, P, max_new_tokens=6)
    assert not body["meta_info"].get("kvx")
    assert body["output_ids"] == ref.greedy(context + question, 6)


def test_a_persisted_context_comes_back_from_disk_token_identical(tiered, tmp_path):
    """Written when stored (--kvx-persist-contexts); the files put back after /flush_cache emptied the
    pool, host memory and the directory -- a restarted server's view -- and a child restores them."""
    name, server, ref = tiered
    server.flush()
    start = server.stats()
    context = ref.encode(text(300, seed=4800))
    question = ref.encode(" Question: which word comes next? Answer:")
    compact(server, context, POLICY, P)
    keep = served_keep_set(server, len(context), POLICY, P)
    before = child(server, context, question, None)
    written = disk_settled(server, disk_contexts=1)  # written by the disk tier's worker, off the scheduler thread
    assert written["disk_files_written"] - start["disk_files_written"] == 1
    saved = tmp_path / "saved"
    shutil.copytree(TIERED_DIR, saved)
    server.flush()
    assert server.stats()["disk_contexts"] == 0 and [p.name for p in TIERED_DIR.iterdir()] == [MARKER]
    for file in saved.iterdir():
        shutil.copy2(file, TIERED_DIR / file.name)
    disk_settled(server, disk_contexts=1)  # the worker's scan found the files put back
    after = child(server, context, question, None)
    outcome = after["meta_info"]["kvx"][-1]
    assert outcome["child"] is True and outcome["restored_from"] == "disk", outcome
    assert after["output_ids"] == before["output_ids"]
    expected_ids, _ = ref.compacted_generate(context, keep, question, 8)
    assert after["output_ids"] == expected_ids
    restored = server.stats()
    assert restored["disk_restores"] - start["disk_restores"] == 1 and restored["disk_files_refused"] == start["disk_files_refused"]
    assert restored["compactions_done"] - start["compactions_done"] == 1  # the restore is no new compaction
