"""Restoring a compacted context from a tier (host memory or disk) against paying its prefill and compaction again.

    OMP_NUM_THREADS=1 python perf/bench_tiers.py [--tier host|disk] [--model tiny-llama] [--lengths 2048,8192]
        [--keep-fraction 0.1]

One real server with one tier of issue #44 on: ``--kvx-host-store-gb`` (``--tier host``) or
``--kvx-context-dir`` on a temporary directory (``--tier disk``: safetensors files plus manifests,
written with fsync; read back through the page cache, which a just-written file is in -- a cold
read from the device is not measured), a pool just large enough for the longest context, no store
reserve. For each context length, ``--repeats`` times, all in one run:

1. a child of the context on an empty store: SGLang's full prefill of context + question (what a
   child of a dropped context pays when nobody re-sends its parent);
2. the parent sent again: prefill + compaction (what it costs to have the context compacted anew);
3. its child served from the pool;
4. a plain request filling the pool pushes the context out to the tier;
5. the same child again: restored from the tier (one copy of the kept bytes; from disk, the file
   read and checked first) and served; it must say ``restored_from`` the tier and answer with the
   same tokens as in 3.

Prints one JSON object: per length the medians, ``restore_s`` (the server's own time to take slots
and copy the entries back), and the ratios ``reprefill_compaction_over_restore`` (the work a
restore replaces, over the restore) and ``child_speedup`` (a re-sent parent plus its child from the
pool, over the restored child). ``--url URL`` runs against a server already running (it must have
the tier on -- and, for ``--tier disk``, no host tier above it -- and ``--kvx-min-store-fraction 0``;
its pool and context length bound the lengths).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import requests

from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, flush_cache, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

QUESTION, NEW_TOKENS = 16, 8
MARGIN = 64  # pool slots beyond the longest context: its child's question and answer


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def post(url: str, input_ids: list[int], max_new_tokens: int, kvx: dict | None) -> tuple[float, dict]:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    if kvx is not None:
        sampling["custom_params"] = {"kvx": kvx}
    t0 = time.perf_counter()
    response = requests.post(url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=1800)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    return seconds, response.json()


def outcome(body: dict) -> dict:
    found = body["meta_info"].get("kvx") or [{}]
    return found[-1]


def flush(url: str) -> None:
    flush_cache(url, timeout=120)  # retried while SGLang still counts the last request as pending


def one_round(url: str, tier: str, length: int, fill: int, kvx: dict, seed: int) -> dict:
    context, question = ids(seed, length), ids(seed + 1, QUESTION)
    flush(url)
    full_prefill_s, cold = post(url, context + question, NEW_TOKENS, kvx)  # nothing stored: SGLang's prefill
    flush(url)  # not even in the radix cache: the parent pays its whole prefill
    reprefill_s, parent = post(url, context, 0, kvx)
    assert outcome(parent).get("compacted") is True, outcome(parent)
    timings = requests.get(url + "/kvx/stats", timeout=60).json()["compacted_contexts"][0]["timings"]
    child_pool_s, from_pool = post(url, context + question, NEW_TOKENS, kvx)
    assert outcome(from_pool).get("child") is True, outcome(from_pool)
    post(url, ids(seed + 2, fill), 1, None)  # plain: it needs the context's slots, which go to the tier
    stats = requests.get(url + "/kvx/stats", timeout=60).json()
    assert stats[f"{tier}_contexts"] == 1 and not stats["compacted_contexts"], f"the context did not move to the {tier} tier"
    child_restored_s, restored = post(url, context + question, NEW_TOKENS, kvx)
    said = outcome(restored)
    assert said.get("restored_from") == tier, said
    assert restored["output_ids"] == from_pool["output_ids"], "the restored child answered differently"
    return {"full_prefill_child_s": full_prefill_s, "reprefill_compaction_s": reprefill_s,
            "compaction_server_s": timings["signals_s"] + timings["score_select_s"] + timings["compact_s"],
            "child_from_pool_s": child_pool_s, "restore_s": said["restore_s"], "child_restored_s": child_restored_s,
            "slots": outcome(parent)["slots"], f"{tier}_bytes": stats[f"{tier}_bytes"],
            "same_tokens_as_full_prefill": cold["output_ids"] == from_pool["output_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--lengths", default="2048,8192", help="comma-separated context lengths (tokens)")
    parser.add_argument("--keep-fraction", type=float, default=0.1)
    parser.add_argument("--policy", default="knorm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tier", choices=("host", "disk"), default="host")
    add_url_option(parser, ("tiers",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("tiers",)).get("tiers")
    lengths = [int(x) for x in args.lengths.split(",")]
    ensure_demo_models()
    path = weights_root() / args.model
    pool = max(lengths) + QUESTION + NEW_TOKENS + MARGIN
    directory = tempfile.TemporaryDirectory(prefix="kvx-bench-tiers-")
    tier_flags = ("--kvx-host-store-gb", "4") if args.tier == "host" else ("--kvx-context-dir", directory.name)
    server = server_or_url(url, path, "--context-length", str(pool), "--kvx-policy", args.policy,
                           "--kvx-keep-fraction", str(args.keep_fraction), "--kvx-min-store-fraction", "0",
                           *tier_flags, max_total_tokens=pool)
    kvx = {"policy": args.policy, "keep_fraction": args.keep_fraction}
    rounds: dict[int, list[dict]] = {n: [] for n in lengths}
    try:
        server.start()
        served = describe(server.url)
        if url:
            served.require_model(path)
            if args.tier == "host" and not served.settings.get("host_store_gb"):
                served.refuse("it needs the host tier on (--kvx-host-store-gb)")
            if args.tier == "disk" and (not served.settings.get("context_dir") or served.settings.get("host_store_gb")):
                served.refuse("it needs the disk tier on (--kvx-context-dir) and no host tier above it")
            if served.settings.get("min_store_fraction"):
                served.refuse("it needs --kvx-min-store-fraction 0 (a plain request must be able to push the context out)")
        fill = min(served.pool_tokens, served.context_length) - 8  # more than the room the stored context leaves
        served.require_context(max(lengths) + QUESTION + NEW_TOKENS + 1, "the longest context and its child")
        for repeat in range(args.repeats):
            for length in lengths:
                rounds[length].append(one_round(server.url, args.tier, length, fill, kvx, seed=1000 * repeat + length))
        flush(server.url)
    finally:
        server.stop()
        directory.cleanup()
    bytes_key = f"{args.tier}_bytes"
    result = {"tier": args.tier, "model": args.model, "policy": args.policy, "keep_fraction": args.keep_fraction,
              "repeats": args.repeats, "question_tokens": QUESTION, "new_tokens": NEW_TOKENS,
              "server": {k: v for k, v in served.summary().items() if k != "url"}, "lengths": {}}
    for length, runs in rounds.items():
        row = {key: round(statistics.median(r[key] for r in runs), 6)
               for key in runs[0] if key not in ("slots", bytes_key, "same_tokens_as_full_prefill")}
        row.update(slots=runs[0]["slots"], **{bytes_key: runs[0][bytes_key]},
                   same_tokens_as_full_prefill=all(r["same_tokens_as_full_prefill"] for r in runs))
        row["reprefill_compaction_over_restore"] = round(row["reprefill_compaction_s"] / row["restore_s"], 1)
        row["child_speedup"] = round((row["reprefill_compaction_s"] + row["child_from_pool_s"]) / row["child_restored_s"], 2)
        row["restored_child_over_pool_child"] = round(row["child_restored_s"] / row["child_from_pool_s"], 3)
        result["lengths"][str(length)] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
