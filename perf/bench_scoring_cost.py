"""Scoring cost against prefill: GateSight served, KVzip's second pass offline.

    OMP_NUM_THREADS=1 python perf/bench_scoring_cost.py [--model tiny-hybrid-deep] [--contexts 4096,8192,16384]

Prints one JSON object; every ratio is measured within one run.
- GateSight (real server): per context length, the plain prefill time of the context (min of two
  runs, compaction off) against the parent's GateSight work (the cheaper of two parents): signal capture inside the forward,
  feature building + the batched estimator op + selection, and the compaction copy.
- KVzip (HF transformers, the offline producer): time of its context-reconstruction second pass
  against the HF prefill of the same context. Both sides run in HF, so the ratio compares like
  with like (the server cannot run KVzip's pass yet).

``--url URL`` runs GateSight's side on a server already running (used as launched, flushed per
length): it must serve the model, a context longer than the longest length and prefill each
context in one chunk, as the server the script starts does (``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import requests
import torch

from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script


WARM_UP = 512  # tokens of the warm-up contexts


def context_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def gatesight_costs(model: str, contexts: list[int], keep_fraction: float, url: str | None = None) -> dict:
    """GateSight's costs per context length on a server of its own, or on the one at ``url``."""
    longest = max(contexts)
    if url:
        served = describe(url)
        served.require_model(weights_root() / model)
        served.require_context(max(longest, WARM_UP) + 1, f"a {max(longest, WARM_UP)}-token context")
        if 0 < served.chunked_prefill_size < longest:
            served.refuse(f"it prefills in chunks of {served.chunked_prefill_size} tokens: the "
                          f"{longest}-token context would not be one chunk (the prefill compared against)")
    server = server_or_url(
        url,
        weights_root() / model, "--kvx-policy", "gatesight", "--kvx-keep-fraction", str(keep_fraction),
        "--context-length", str(longest + 512), "--chunked-prefill-size", str(longest),
        "--mem-fraction-static", "0.3",  # SGLang derives a negative one from a large chunked prefill on CPU
        max_total_tokens=2 * longest + 1024,
    )
    out = {}
    with server:
        def prefill(ids, kvx):
            r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvx": kvx}}}, timeout=1200)
            r.raise_for_status()

        prefill(context_ids(WARM_UP, 7), {"compact": False})  # warm-up: the plain prefill path
        prefill(context_ids(WARM_UP, 8), {"policy": "gatesight", "keep_fraction": keep_fraction})  # and the capture/scoring path
        for n in contexts:
            server.flush()
            times = []
            for i in range(2):
                t0 = time.perf_counter()
                prefill(context_ids(n, 100 + i), {"compact": False})
                times.append(time.perf_counter() - t0)
            # GateSight's side, like the prefill's, is the better of two runs (another context each).
            runs = []
            for i in range(2):
                server.flush()
                prefill(context_ids(n, 200 + i), {"policy": "gatesight", "keep_fraction": keep_fraction})
                runs.append([c for c in server.stats()["compacted_contexts"] if c["context_tokens"] == n][0])
            def scoring_s(entry: dict) -> float:
                return sum(entry["timings"][k] for k in ("capture_s", "signals_s", "score_select_s"))
            entry = min(runs, key=scoring_s)
            t = entry["timings"]
            prefill_s = min(times)
            scoring = scoring_s(entry)
            out[str(n)] = {
                "prefill_s": round(prefill_s, 4),
                "capture_s": round(t["capture_s"], 4),
                "signals_s": round(t["signals_s"], 4),
                "score_select_s": round(t["score_select_s"], 4),
                "compact_s": round(t["compact_s"], 4),
                "scoring_frac_of_prefill": round(scoring / prefill_s, 4),
                "scoring_plus_compaction_frac_of_prefill": round((scoring + t["compact_s"]) / prefill_s, 4),
                "kept_entries": entry["kept_entries"],
            }
    return out


def kvzip_costs(model: str, contexts: list[int]) -> dict:
    from sglang_kvx.reference.hf import HFReference
    from sglang_kvx.reference.kvzip import reconstruction_attention

    ref = HFReference(weights_root() / model)
    out = {}
    with torch.no_grad():
        ref.model(torch.tensor([context_ids(256, 1)]), use_cache=True)  # warm-up
        for n in contexts:
            ids = context_ids(n, 300)
            t0 = time.perf_counter()
            ref.model(torch.tensor([ids]), use_cache=True)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            reconstruction_attention(ref, ids)  # its own prefill, then the second pass
            second_pass_s = time.perf_counter() - t0 - prefill_s
            out[str(n)] = {"hf_prefill_s": round(prefill_s, 4), "second_pass_s": round(second_pass_s, 4),
                           "second_pass_frac_of_prefill": round(second_pass_s / prefill_s, 4)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--contexts", default="4096,8192,16384")
    parser.add_argument("--kvzip-contexts", default="4096", help="KVzip's HF pass is slow on CPU; keep this short")
    parser.add_argument("--keep-fraction", type=float, default=0.1)
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    torch.set_num_threads(1)
    ensure_demo_models()
    contexts = [int(x) for x in args.contexts.split(",")]
    result = {
        "model": args.model,
        "keep_fraction": args.keep_fraction,
        "gatesight": gatesight_costs(args.model, contexts, args.keep_fraction, url),
        "kvzip": kvzip_costs(args.model, [int(x) for x in args.kvzip_contexts.split(",") if x]),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
