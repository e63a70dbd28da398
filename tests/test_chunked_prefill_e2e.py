"""Long contexts as users send them: a parent prefilled in many chunks is compacted exactly as one
prefilled in a single chunk, for every served policy.

Signals recorded inside the prefill (SnapKV's window queries, H2O's column sums, TriAttention's
query statistics, GateSight's GDN signals and output gates, KVzip's reconstruction passes) are
accumulated chunk by chunk; this compares the keep-sets of two real servers that differ only in
``--chunked-prefill-size``: a server prefilling in chunks of 512 tokens, and the shared compacting
server, whose default chunk (4,096 on CPU) holds the whole context. The 64K-token run with SGLang's GPU chunk size (8,192) is
``perf/bench_compaction.py --context 65536 --chunked-prefill-size 8192 --check-chunking``.
"""

from __future__ import annotations

import random
import time

import pytest
import requests

from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.policies import servable_policy_names

from server_pool import CHUNK

CONTEXT_WORDS = 950  # about 1,850 tokens: four chunks of 512 (and KVzip's pass fits the shared servers' 4,096)


def keep_sets(server, context: list[int]) -> dict[str, dict]:
    """Every served policy's stored context on ``server``."""
    out = {}
    failed = server.stats()["compactions_failed"]
    for policy in servable_policy_names():
        kvx = {"policy": policy, "keep_fraction": 0.2, "protected_prefix_len": 4}
        response = server.generate({"input_ids": context, "sampling_params": {
            "max_new_tokens": 0, "custom_params": {"kvx": kvx}}})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 300
        while server.stats()["second_passes_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
    stats = server.stats()
    assert stats["compactions_failed"] == failed, stats["last_compaction_error"]
    for entry in requests.get(server.url + "/kvx/keep_sets", timeout=60).json():
        out[entry["policy"]] = entry
    return out


@pytest.mark.slow
def test_many_chunks_keep_what_one_chunk_keeps(shared_server, compacting_hybrid) -> None:
    whole_server, ref = compacting_hybrid
    chunked_server = shared_server("chunked", "tiny-hybrid-deep")
    rng = random.Random(17)
    context = ref.encode(" ".join(rng.choice(WORDS) for _ in range(CONTEXT_WORDS)) + "\n")
    assert len(context) > 3 * CHUNK
    chunked = keep_sets(chunked_server, context)
    whole = keep_sets(whole_server, context)
    assert sorted(chunked) == sorted(whole) == sorted(servable_policy_names())
    for policy in whole:
        assert chunked[policy]["kept_entries"] == whole[policy]["kept_entries"], policy
        assert chunked[policy]["positions"] == whole[policy]["positions"], policy
