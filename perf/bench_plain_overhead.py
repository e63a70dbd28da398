"""What the extension costs requests it does not compact: --kvx-policy none against an active policy.

    OMP_NUM_THREADS=1 python perf/bench_plain_overhead.py [--model tiny-hybrid-deep] [--requests 200]

Two real servers on the same model run side by side: one with ``--kvx-policy none`` (the plugin
loaded, doing nothing) and one with ``--kvx-policy knorm`` holding one compacted context (so every
request is checked against the store). The same plain requests (not parents, not children: a
128-token prompt, 16 greedy tokens) go to both, alternating, so the machine's noise hits both
arms alike. Prints one JSON object: per-arm mean and median latency, and their ratio.

``--url none=URL`` / ``--url knorm=URL`` run an arm against a server already running (flushed first,
then used as launched): the ``none`` arm's must serve ``--kvx-policy none``, the active arm's any
compacting policy (its default policy compacts the stored context); ``arm_servers`` records each
arm's served policy, keep fraction and pool (``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import requests

from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

ARMS = ("none", "knorm")  # the plugin idle; an active policy holding one compacted context


def prompt(seed: int, n: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def timed(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    response = requests.post(url + "/generate", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=200)
    add_url_option(parser, ARMS)
    args = parser.parse_args()
    urls = urls_from_args(parser, args.url, ARMS)
    ensure_demo_models()
    path = weights_root() / args.model
    arms = {
        "none": server_or_url(urls.get("none"), path, "--kvx-policy", "none", max_total_tokens=16384),
        "knorm": server_or_url(urls.get("knorm"), path, "--kvx-policy", "knorm", "--kvx-keep-fraction", "0.5",
                               max_total_tokens=16384),
    }
    latencies: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for server in arms.values():
            server.start()
        served = {name: describe(server.url) for name, server in arms.items()}
        for name in urls:
            served[name].require_model(path)
            served[name].require_context(1024 + 1, "the stored 1,024-token context")
            arms[name].flush()  # its store holds this run's context alone
        if served["none"].policy != "none":
            served["none"].refuse(f"the 'none' arm needs --kvx-policy none; it serves {served['none'].policy}")
        if served["knorm"].policy == "none":
            served["knorm"].refuse("the active arm needs a compacting --kvx-policy; it serves none")
        # One compacted context in the active arm's store: every plain request is looked up against it.
        timed(arms["knorm"].url, {"input_ids": prompt(-1, 1024), "sampling_params": {"max_new_tokens": 0}})
        for i in range(args.requests + 10):
            body = {"input_ids": prompt(i), "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
            order = list(arms) if i % 2 == 0 else list(reversed(arms))
            for name in order:
                seconds = timed(arms[name].url, body)
                if i >= 10:  # the first requests warm both servers up
                    latencies[name].append(seconds)
        stored = arms["knorm"].stats()["compacted_contexts"]
    finally:
        for server in arms.values():
            server.stop()
    result = {"model": args.model, "requests_per_arm": args.requests, "prompt_tokens": 128, "new_tokens": 16,
              "active_arm_store_contexts": len(stored),
              "arm_servers": {name: {k: v for k, v in facts.summary().items() if k != "url"}
                              for name, facts in served.items()}}
    for name, values in latencies.items():
        result[f"{name}_mean_s"] = round(statistics.mean(values), 5)
        result[f"{name}_median_s"] = round(statistics.median(values), 5)
    result["active_over_none_mean"] = round(result["knorm_mean_s"] / result["none_mean_s"], 4)
    result["active_over_none_median"] = round(result["knorm_median_s"] / result["none_median_s"], 4)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
