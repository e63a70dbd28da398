"""Compaction cost and capacity on a real server: one long context, every served policy.

    OMP_NUM_THREADS=1 python perf/bench_compaction.py [--model tiny-hybrid] [--context 4096] [--keep-fraction 0.1]

Prints one JSON object. All ratios are measured in one run (these machines are noisy):
prefill time of the context (a plain request of the same length), then per policy the
server-side time to read signals, score+select and compact, as fractions of that prefill;
bytes moved by the compaction copy; bytes freed versus the theoretical (1 - p) of the
context's attention KV; the time of one child on the compacted context (16-token question,
32 tokens out); and how many compacted sessions fit in the pool versus uncompacted.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import requests

from sglang_kvx.policies import servable_policy_names
from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import ServerProcess


def context_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--keep-fraction", type=float, default=0.1)
    parser.add_argument("--pool", type=int, default=32768, help="--max-total-tokens of the server")
    args = parser.parse_args()
    ensure_demo_models()
    n, p = args.context, args.keep_fraction
    policies = servable_policy_names()
    result: dict = {"model": args.model, "context_tokens": n, "keep_fraction": p, "pool_tokens": args.pool}
    server = ServerProcess(
        weights_root() / args.model, "--kvx-policy", "streamingllm", "--kvx-keep-fraction", str(p),
        "--context-length", str(2 * n + 512), max_total_tokens=args.pool,  # 2n: KVzip's reconstruction pass
    )
    with server:
        url = server.url

        def prefill(ids, kvx):
            t0 = time.perf_counter()
            r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvx": kvx}}}, timeout=600)
            r.raise_for_status()
            return time.perf_counter() - t0

        def child(ids, policy):
            # A child on the compacted context: a 16-token question, 32 greedy tokens (per-layer budgets
            # send its attention through the masked path; flat ones through the backend's own).
            question = [7 + (i % 50) for i in range(16)]
            t0 = time.perf_counter()
            r = requests.post(url + "/generate", json={"input_ids": ids + question, "sampling_params": {
                "max_new_tokens": 32, "min_new_tokens": 32, "temperature": 0,
                "custom_params": {"kvx": {"policy": policy, "keep_fraction": p}}}}, timeout=600)
            r.raise_for_status()
            return time.perf_counter() - t0

        prefill(context_ids(n, 999), {"compact": False})  # warm-up
        prefill_s = min(prefill(context_ids(n, 1000 + i), {"compact": False}) for i in range(2))
        server.flush()
        result["prefill_s"] = round(prefill_s, 4)
        per_policy = {}
        for i, policy in enumerate(policies):
            before = server.stats()["kv_pool_free_tokens"]
            t0 = time.perf_counter()
            prefill(context_ids(n, i), {"policy": policy, "keep_fraction": p})
            while server.stats()["kvzip_passes_pending"]:  # KVzip compacts after its second pass
                time.sleep(0.05)
            total_s = time.perf_counter() - t0
            stats = server.stats()
            entry = [c for c in stats["compacted_contexts"] if c["policy"] == policy][0]
            t = {k: entry["timings"].get(k, 0.0) for k in
                 ("capture_s", "signals_s", "second_pass_s", "accumulate_s", "score_select_s", "compact_s", "bytes_moved")}
            scoring_s = t["capture_s"] + t["signals_s"] + t["second_pass_s"] + t["score_select_s"]
            freed_tokens = n - entry["slots"]
            per_policy[policy] = {
                "capture_frac_of_prefill": round(t["capture_s"] / prefill_s, 4),  # inside the prefill's forward
                "signals_frac_of_prefill": round(t["signals_s"] / prefill_s, 4),
                "second_pass_frac_of_prefill": round(t["second_pass_s"] / prefill_s, 4),  # KVzip only
                "score_select_frac_of_prefill": round(t["score_select_s"] / prefill_s, 4),
                "compact_frac_of_prefill": round(t["compact_s"] / prefill_s, 4),
                "scoring_plus_compaction_frac_of_prefill": round((scoring_s + t["compact_s"]) / prefill_s, 4),
                "parent_request_s": round(total_s, 4),
                "bytes_moved": t["bytes_moved"],
                "bytes_freed": freed_tokens * (stats["kv_bytes_total"] // stats["kv_pool_total_tokens"]),
                "freed_vs_theoretical": round(freed_tokens / ((1 - p) * n), 4),
                "pool_free_delta_tokens": before - stats["kv_pool_free_tokens"],
                "kept_entries": entry["kept_entries"],
                "slots": entry["slots"],
                "folded_entries": entry["folded_entries"],
                "child_s": round(child(context_ids(n, i), policy), 4),
            }
        result["policies"] = per_policy
        server.flush()

        # Capacity: keep compacting new contexts while a parent's full prefill still fits.
        sessions = 0
        while server.stats()["kv_pool_free_tokens"] >= n + 64:
            prefill(context_ids(n, 5000 + sessions), {"policy": "streamingllm", "keep_fraction": p})
            sessions += 1
        stats = server.stats()
        result["compacted_sessions_fit"] = sessions
        result["uncompacted_sessions_fit"] = args.pool // n
        result["sessions_ratio"] = round(sessions / max(1, args.pool // n), 2)
        result["store_slots"] = stats["store_slots"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
