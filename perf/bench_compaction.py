"""Compaction cost and capacity on a real server: one long context, every served policy.

    OMP_NUM_THREADS=1 python perf/bench_compaction.py [--model tiny-hybrid] [--context 4096] [--keep-fraction 0.1]
    OMP_NUM_THREADS=1 python perf/bench_compaction.py --context 65536 --chunked-prefill-size 8192 \
        --check-chunking --pool 140000 --skip-capacity      # a long context as GPU servers chunk it
    OMP_NUM_THREADS=1 python perf/bench_compaction.py --model smollm2-135m-instruct --context 2048 \
        --keep-fraction 0.2 --policies kvzip,kvzip_plus,kvzap,kvzap_linear,keydiff --skip-capacity   # issue #57

Prints one JSON object. All ratios are measured in one run (these machines are noisy):
prefill time of the context (a plain request of the same length), then per policy the
server-side time to read signals, score+select and compact, as fractions of that prefill;
bytes moved by the compaction copy; bytes freed versus the theoretical (1 - p) of the
context's attention KV; the time of one child on the compacted context (16-token question,
32 tokens out); and how many compacted sessions fit in the pool versus uncompacted.
``parent_frac_of_prefill`` is the whole parent request (its prefill with whatever it records, second
passes, scoring, compaction) over the plain prefill: what a context costs end to end. ``--policies``
runs a subset; without it, a policy the server refuses for this model (a 4xx: GateSight's estimators,
KVzap's surrogates trained for another checkpoint) is reported as ``refused`` and skipped. Per policy also the peak bytes of the signals the parent's prefill recorded (measured on the
server: every tensor its recording holds, at its largest) beside one float32 [n, query heads]
tensor per attention layer and, on a hybrid, float32 beta, g and ||v|| of every GDN layer for
the whole context (both computed: what full-context copies of all layers would hold; GateSight
is scored chunk by chunk inside the prefill, so it holds neither). ``--check-chunking`` compacts the same
contexts on a second server prefilling each in one chunk and reports whether the keep-sets match.

``--url server=URL`` / ``--url one_chunk=URL`` run against servers already running (each is flushed
first, then used as it was launched): the pool and chunk size reported are theirs (``perf/served.py``),
and one that cannot hold the run (context length under 2 n + 512 for KVzip's passes, another model,
a "one-chunk" server that chunks the context) is refused.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import requests

from sglang_kvx.policies import servable_policy_names
from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import agree, describe  # perf/ is on the path when run as a script

ARMS = ("server", "one_chunk")  # the main server; the one-chunk server of --check-chunking


STEP_TIMEOUT_S = 3600  # stats wait for the scheduler's step: one KVzip pass over a 64K context is minutes on CPU


def context_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--keep-fraction", type=float, default=0.1)
    parser.add_argument("--pool", type=int, default=32768, help="--max-total-tokens of the server")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="the server's --chunked-prefill-size (default: SGLang's)")
    parser.add_argument("--check-chunking", action="store_true",
                        help="also compact every context on a one-chunk server and compare the keep-sets")
    parser.add_argument("--skip-capacity", action="store_true", help="skip the sessions-per-pool count")
    parser.add_argument("--policies", default="", help="comma-separated subset of the served policies (default: all)")
    add_url_option(parser, ARMS)
    args = parser.parse_args()
    urls = urls_from_args(parser, args.url, ARMS)
    if "one_chunk" in urls and not args.check_chunking:
        parser.error("--url one_chunk=URL is the server of --check-chunking: pass --check-chunking too")
    ensure_demo_models()
    n, p = args.context, args.keep_fraction
    path = weights_root() / args.model
    policies = [name for name in args.policies.split(",") if name] or servable_policy_names()
    if unknown := sorted(set(policies) - set(servable_policy_names())):
        parser.error(f"--policies: not served: {', '.join(unknown)}")
    context_length = 2 * n + 512  # KVzip's reconstruction passes
    flags = ["--kvx-policy", "streamingllm", "--kvx-keep-fraction", str(p), "--context-length", str(context_length)]
    chunking = [] if args.chunked_prefill_size is None else ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}  # RoPE past the demo models' 32K training length
    config = json.loads((path / "config.json").read_text())
    server = server_or_url(urls.get("server"), path, *flags, *chunking, max_total_tokens=args.pool, env=env)
    with server:
        if "server" in urls:  # its pool and chunk size stand, and only this run's contexts are counted
            served = describe(server.url)
            served.require_model(path)
            served.require_context(context_length, f"a {n}-token context with KVzip's reconstruction passes")
            pool = agree(parser, args, "pool", served.pool_tokens, server.url)
            chunk = agree(parser, args, "chunked_prefill_size", served.chunked_prefill_size, server.url)
            server.flush()
        else:
            pool, chunk = args.pool, args.chunked_prefill_size
        result: dict = {"model": args.model, "context_tokens": n, "keep_fraction": p, "pool_tokens": pool,
                        "chunked_prefill_size": chunk}
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
            try:
                prefill(context_ids(n, i), {"policy": policy, "keep_fraction": p})
            except requests.HTTPError as exc:  # a policy whose resources this model lacks (KVzap's surrogates)
                if args.policies or exc.response is None or not 400 <= exc.response.status_code < 500:
                    raise
                per_policy[policy] = {"refused": exc.response.text[:300]}
                continue
            while server.stats(timeout=STEP_TIMEOUT_S)["second_passes_pending"]:  # KVzip compacts after its second pass
                time.sleep(0.05)
            total_s = time.perf_counter() - t0
            stats = server.stats()
            entries = [c for c in stats["compacted_contexts"] if c["policy"] == policy]
            if not entries:
                raise SystemExit(f"{policy}: the context was not compacted: {stats['last_compaction_error']} {stats}")
            entry = entries[0]
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
                "parent_frac_of_prefill": round(total_s / prefill_s, 4),
                "parent_request_s": round(total_s, 4),
                "bytes_moved": t["bytes_moved"],
                "bytes_freed": freed_tokens * (stats["kv_bytes_total"] // stats["kv_pool_total_tokens"]),
                "freed_vs_theoretical": round(freed_tokens / ((1 - p) * n), 4),
                "pool_free_delta_tokens": before - stats["kv_pool_free_tokens"],
                "kept_entries": entry["kept_entries"],
                "slots": entry["slots"],
                "folded_entries": entry["folded_entries"],
                "recorded_signal_bytes": int(entry["timings"].get("recorded_signal_bytes", 0)),
                "child_s": round(child(context_ids(n, i), policy), 4),
            }
        result["policies"] = per_policy
        num_attention_layers = len(entry["kept_entries"])
        result["full_context_all_layers_f32_bytes_computed"] = n * config["num_attention_heads"] * num_attention_layers * 4
        gdn_layers = sum(kind == "linear_attention" for kind in config.get("layer_types", []))
        if gdn_layers:
            result["full_context_gdn_signals_f32_bytes_computed"] = n * gdn_layers * config["linear_num_value_heads"] * 3 * 4
        chunked_keeps = keep_sets(url) if args.check_chunking else {}
        server.flush()

        # Capacity: keep compacting new contexts while a parent's full prefill still fits (idle radix
        # entries count as room: SGLang evicts them; with chunked prefill a parent's chunks stay there).
        def room() -> int:
            stats = server.stats()
            return stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"]

        sessions = 0
        while not args.skip_capacity and room() >= n + 64:
            done = server.stats()["compactions_done"]
            prefill(context_ids(n, 5000 + sessions), {"policy": "streamingllm", "keep_fraction": p})
            # A parent prefilled but left uncompacted (no room beside it for its kept entries) goes back to
            # the radix cache as evictable: the room stays the same and the loop would never end.
            if server.stats()["compactions_done"] == done:
                break
            sessions += 1
        if not args.skip_capacity:
            result["compacted_sessions_fit"] = sessions
            result["uncompacted_sessions_fit"] = pool // n
            result["sessions_ratio"] = round(sessions / max(1, pool // n), 2)
            result["store_slots"] = server.stats()["store_slots"]
    server.wait_for_exit()  # its memory back before the next server sizes its pool
    if args.check_chunking:
        # SGLang derives its default --mem-fraction-static from the chunk size; past ~16K it turns
        # negative on a small machine, so name one (the pool is --max-total-tokens either way).
        one_chunk = server_or_url(urls.get("one_chunk"), path, *flags, "--chunked-prefill-size", str(n + 1024),
                                  "--mem-fraction-static", "0.8", max_total_tokens=args.pool, env=env)
        with one_chunk:
            if "one_chunk" in urls:
                served = describe(one_chunk.url)
                served.require_model(path)
                served.require_context(context_length, f"a {n}-token context with KVzip's reconstruction passes")
                if 0 < served.chunked_prefill_size < n:
                    served.refuse(f"it prefills in chunks of {served.chunked_prefill_size} tokens: "
                                  f"not a one-chunk server for a {n}-token context")
                one_chunk.flush()
            for i, policy in enumerate(policies):
                if "refused" in result["policies"][policy]:
                    continue
                requests.post(one_chunk.url + "/generate", json={"input_ids": context_ids(n, i), "sampling_params": {
                    "max_new_tokens": 0, "custom_params": {"kvx": {"policy": policy, "keep_fraction": p}}}},
                    timeout=3600).raise_for_status()
                while one_chunk.stats(timeout=STEP_TIMEOUT_S)["second_passes_pending"]:
                    time.sleep(0.05)
            whole_keeps = keep_sets(one_chunk.url)
        for policy in policies:
            if "refused" in result["policies"][policy]:
                continue
            a, b = chunked_keeps[policy], whole_keeps[policy]
            same = sum(len(set(x) & set(y)) for la, lb in zip(a, b) for x, y in zip(la, lb))
            total = sum(len(y) for lb in b for y in lb)
            result["policies"][policy]["keep_set_equal_to_one_chunk"] = a == b
            result["policies"][policy]["keep_set_overlap_with_one_chunk"] = round(same / total, 6)
    print(json.dumps(result, indent=1))


def keep_sets(url: str) -> dict[str, list]:
    """Each stored context's kept positions per layer and KV head, by policy."""
    return {e["policy"]: e["positions"] for e in requests.get(url + "/kvx/keep_sets", timeout=600).json()}


if __name__ == "__main__":
    main()
