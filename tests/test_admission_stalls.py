"""No request waits forever behind the store's reserve (issue #41 item 2), end to end.

The stall once reported: with contexts stored under the store's reserve, a request needing more
slots than the pool minus that reserve waited forever, and every request behind it too (an 8-token
probe took 94 s); ``max_new_tokens: null`` ended in a 500 after 150 s (now: it generates up to the room
the reserve leaves, as plain SGLang up to the pool). The shared servers cannot
show it (their context length is below the pool minus the reserve), so this file starts one of its
own whose context length is the whole pool. Every request runs under a watchdog: an answer within
``WATCHDOG`` seconds or the test fails.
"""

from __future__ import annotations

import random
import time

import pytest
import requests

from sglang_kvx.serve.launcher import ServerProcess
from server_pool import FORKSERVER_START

POOL = 2048
WATCHDOG = 30.0  # seconds: far above what these requests take when nothing waits (well under 1 s)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _timed(server: ServerProcess, payload: dict) -> tuple[requests.Response, float]:
    start = time.monotonic()
    response = server.generate(payload, timeout=WATCHDOG)  # raises past the watchdog
    return response, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.fresh_process
def test_requests_the_reserve_blocks_are_refused_at_once_and_block_nobody(demo_paths, tmp_path, server_pool) -> None:
    with ServerProcess(demo_paths["tiny-llama"], "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5",
                       "--context-length", str(POOL), "--kvx-min-store-fraction", "0.5",
                       max_total_tokens=POOL, log_path=tmp_path / "server.log", env=FORKSERVER_START,
                       **server_pool.zygote.starting()) as server:
        for seed, tenant in enumerate(("a", "b")):  # two tenants' contexts, both within the reserve
            parent, _ = _timed(server, {"input_ids": _ids(900, seed), "sampling_params": {
                "max_new_tokens": 0, "custom_params": {"kvx": {"tenant": tenant}}}})
            assert parent.status_code == 200 and parent.json()["meta_info"]["kvx"][0]["compacted"], parent.text
        stats = server.stats()
        assert stats["store_reserved_slots"] == stats["store_slots"] == 900, stats
        probe = {"input_ids": _ids(20, 7), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        expected = server.generate(probe).json()["output_ids"]
        # 1,500 + 500 slots: more than the 2,048 - 900 the reserve leaves; then the same with
        # max_new_tokens null (SGLang counts it up to the context length).
        for max_new_tokens in (500, None):
            big = {"input_ids": _ids(1500, 9), "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
            refused, seconds = _timed(server, big)
            assert refused.status_code == 400, refused.text
            assert "--kvx-min-store-fraction" in refused.text and seconds < 5, (seconds, refused.text)
            answered, seconds = _timed(server, probe)  # nothing queued behind it
            assert answered.status_code == 200 and answered.json()["output_ids"] == expected and seconds < 5, seconds
        # max_new_tokens null with a prompt that fits: generated up to the room the reserve leaves, as
        # plain SGLang generates up to the pool (finish reason "length"), never refused or stalled.
        unbounded, seconds = _timed(server, {"input_ids": _ids(900, 11), "sampling_params": {
            "max_new_tokens": None, "ignore_eos": True}})
        assert unbounded.status_code == 200, unbounded.text
        meta = unbounded.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and 100 < meta["completion_tokens"] <= POOL - 900 - 900, meta
        answered, seconds = _timed(server, probe)
        assert answered.status_code == 200 and answered.json()["output_ids"] == expected and seconds < 5, seconds
        # What fits beside the reserve is served, in full.
        fits, _ = _timed(server, {"input_ids": _ids(900, 10), "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
        assert fits.status_code == 200 and len(fits.json()["output_ids"]) == 200, fits.text
        server.flush()
        stats = server.stats()
        assert stats["kv_pool_free_tokens"] == stats["kv_pool_total_tokens"] and stats["store_slots"] == 0, stats
