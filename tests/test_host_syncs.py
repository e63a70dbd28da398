"""Issue #56 item 3: the host-sync budget of one decode step, measured on CPU on a real server.

A server started with ``SGLANG_KVX_COUNT_HOST_SYNCS=1`` counts, over each whole forward, every call
that would make a GPU wait for the host or copy host data to it (``ops/host_syncs.py``). A batch of
8 rows of one kind decodes together; its last decode forward's count, less a plain batch's (SGLang's
own), is the extension's share per decode step -- not per layer. Budgets: at most 1 for children of
the flat and per-layer (folded) allocations and for StreamingLLM and span_schedule rows (their page
tables' counts, copied once per batch; a child's tables carry over from its batch's last step, 0); children of the per-head ``global`` allocation too (one list
per row and KV head). On-Demand Attention: 2 -- its Local run's tables and its recall head's scores
read back (the host decides which rows re-run); when only some rows re-run Full, those rows' index for
the sub-batch is built on the device from the host's positions (``ops.host_syncs.device_positions``:
no copy).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from server_pool import SERVER_ARGS, spec
from test_compaction_e2e import text

ROWS, CONTEXT, QUESTION = 8, 400, 12
SPAN = {"sinks": 4, "window": 32}
KINDS = {  # kind -> (what each request carries in custom_params.kvx, budget per decode step)
    "flat": ({"allocation": "flat"}, 1),
    "pyramidkv": ({"allocation": "pyramidkv"}, 1),
    "global": ({"allocation": "global"}, 1),
    "streamingllm": ({"decode": {"step": "streamingllm", **SPAN}}, 1),
    "span_schedule": ({"decode": {"step": "span_schedule", **SPAN, "full_every": 3}}, 1),
    # ODA: its Local run's tables and the recall head's scores read back (the host decides the re-run)
    "oda": ({"decode": {"step": "oda", **SPAN}}, 2),
}


@pytest.fixture
def counting(demo_paths, seeded_oda_heads, references, server_pool):
    server = server_pool.get(spec(demo_paths["tiny-llama"], *SERVER_ARGS, "--kvx-policy", "keydiff",
                                  "--kvx-keep-fraction", "0.5", "--kvx-decode-steps", "on",
                                  "--kvx-oda-head", str(seeded_oda_heads["tiny-llama"]),
                                  env={"SGLANG_KVX_COUNT_HOST_SYNCS": "1"}))
    return server, references["tiny-llama"]


def last_decode_count(server, ref, fields: dict | None, seed: int, tries: int = 3) -> dict:
    """A batch of ROWS requests of one kind decoding together: its last decode forward's count by kind. Where
    the ROWS requests never decoded as one batch (a loaded machine staggers their prefills), tried again."""
    for _ in range(tries):
        before = server.stats()["host_syncs"].get(f"decode[{ROWS}]", {}).get("forward", 0)
        counted = one_batch_count(server, ref, fields, seed)
        if counted is not None and counted["forward"] > before:
            return counted
    raise AssertionError(f"{ROWS} rows of {fields} never decoded as one batch in {tries} tries")


def one_batch_count(server, ref, fields: dict | None, seed: int) -> dict | None:
    context = ref.encode(text(CONTEXT, seed=seed))
    child = fields is not None and "allocation" in fields
    if child:  # the parent, compacted with this allocation
        parent = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0,
                                                                            "custom_params": {"kvx": fields}}})
        assert parent.status_code == 200, parent.text
    bodies = []
    for row in range(ROWS):
        ids = (context if child else ref.encode(text(CONTEXT, seed=seed * 100 + row))) + ref.encode(
            text(QUESTION, seed=seed * 1000 + row))
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        if fields is not None:
            params["custom_params"] = {"kvx": fields}
        bodies.append({"input_ids": ids, "sampling_params": params})
    with ThreadPoolExecutor(ROWS) as pool:
        responses = list(pool.map(server.generate, bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    if child:
        assert all(r.json()["meta_info"]["kvx"][-1].get("child") for r in responses)
    counted = server.stats()["host_syncs"].get(f"decode[{ROWS}]")
    server.flush()
    return counted


@pytest.mark.slow
def test_one_decode_step_syncs_at_most_its_budget_whatever_its_rows_read(counting):
    server, ref = counting
    plain = last_decode_count(server, ref, None, seed=70)["total"]
    counts = {kind: last_decode_count(server, ref, fields, seed=71 + i) for i, (kind, (fields, _)) in enumerate(KINDS.items())}
    over = {kind: counted["total"] - plain for kind, counted in counts.items()}
    assert all(over[kind] <= budget for kind, (_, budget) in KINDS.items()), (plain, counts)
    # The counter sees this path at all: a span's tables, rebuilt every step (it slides), copy their counts once;
    # children's tables carry over from the last step (serve/page_tables.TableCarry): nothing copied
    assert over["streamingllm"] == 1 and over["pyramidkv"] == 0 and over["global"] == 0, over
    # ODA's costliest step, where only some rows re-run Full (a sub-batch): within the same budget
    partial = server.stats()["host_syncs"].get(f"decode[{ROWS}] partial re-run")
    assert partial is not None and partial["forward"] > counts["span_schedule"]["forward"], partial
    assert partial["total"] - plain <= KINDS["oda"][1], partial
