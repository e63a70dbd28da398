"""SGLang's own benchmark against plain SGLang and the extension's arms, side by side (issue #55 item 3).

    OMP_NUM_THREADS=1 python perf/bench_serving_shared_prefix.py [--model tiny-llama] [--arms plain,auto,host,disk]
        [--distributions uniform,zipf] [--groups 48] [--prompts-per-group 4] [--system-prompt-len 1850]
        [--question-len 64] [--output-len 16] [--concurrency 4] [--pool 12288]

For each group distribution and each arm, one real server is started (one after the other, on this
machine, with the same pool: ``--max-total-tokens --pool``) and ``python -m sglang.benchmark.serving
--dataset-name generated-shared-prefix`` -- an unmodified client nobody here wrote -- runs against it
with ``--cache-report``: groups of prompts sharing a long system prompt, a pool that holds a small
fraction of the groups' prompts. The arms:

- ``plain``: SGLang with the extension idle (``--kvx-policy none``);
- ``auto``: the shared system prompts compacted unasked (``--kvx-auto-context-min-tokens``: the second
  prompt of a group marks its beginning a context) with ``--kvx-policy keydiff --kvx-keep-fraction``;
- ``host``: ``auto`` plus the host-memory tier (``--kvx-host-store-gb``);
- ``disk``: ``auto`` plus the disk tier (``--kvx-context-dir`` on a temporary directory);
- ``hicache``: SGLang's own hierarchical cache (``--enable-hierarchical-cache``), which does not start
  on a CPU machine (its host pool is pinned with cudaHostRegister): the arm records the error.

Printed, last, one JSON object: per distribution and arm bench_serving's own figures (completed
requests, request throughput, output tokens/s, TTFT and TPOT medians and p99, its cache-report hit
rate), whether the server was alive after the run, and each extension arm's ratios to ``plain``
measured in the same run. The workload's prompts are cached by bench_serving under a temporary HOME.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import ServerProcess

FIGURES = ("completed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "p99_tpot_ms", "duration")


def model_path(name: str) -> str:
    if name == "smollm2":
        from sglang_kvx.models.smollm2 import convert_smollm2

        return str(convert_smollm2())
    ensure_demo_models()
    return str(weights_root() / name)


def arm_flags(arm: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    compacting = ["--kvx-policy", args.policy, "--kvx-keep-fraction", str(args.keep_fraction),
                  "--kvx-auto-context-min-tokens", str(args.auto_min_tokens)]
    return {
        "plain": ["--kvx-policy", "none"],
        "auto": compacting,
        "host": compacting + ["--kvx-host-store-gb", str(args.host_store_gb)],
        "disk": compacting + ["--kvx-context-dir", str(scratch / "contexts")],
        "hicache": ["--enable-hierarchical-cache"],
    }[arm]


def run_bench(url_port: int, path: str, args: argparse.Namespace, distribution: str, out: Path, home: Path) -> dict:
    command = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
               "--port", str(url_port), "--model", path, "--tokenizer", path,
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
               "--gsp-prompts-per-group", str(args.prompts_per_group),
               "--gsp-system-prompt-len", str(args.system_prompt_len), "--gsp-question-len", str(args.question_len),
               "--gsp-output-len", str(args.output_len), "--gsp-group-distribution", distribution,
               "--max-concurrency", str(args.concurrency), "--cache-report", "--seed", str(args.seed),
               "--output-file", str(out), "--output-details"]
    if distribution == "zipf":
        command += ["--gsp-zipf-alpha", str(args.zipf_alpha)]
    env = dict(os.environ, HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"bench_serving exited {proc.returncode}: {proc.stderr[-1500:]}"}
    result = json.loads(out.read_text().strip().splitlines()[-1])
    figures = {key: result.get(key) for key in FIGURES}
    report = result.get("cache_report") or {}
    figures["cache_hit_rate_pct"] = report.get("cache_hit_rate_pct")
    figures["cache_report"] = report
    figures["outputs"] = result.get("generated_texts")
    figures["errors"] = sum(1 for error in result.get("errors") or [] if error)
    return figures


def one_arm(arm: str, path: str, args: argparse.Namespace, distribution: str, scratch: Path) -> dict:
    log = scratch / f"{arm}-{distribution}.log"
    server = ServerProcess(path, *arm_flags(arm, args, scratch), max_total_tokens=args.pool, log_path=log)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        lines = [line for line in str(exc).splitlines() if "Error" in line or "error" in line]
        return {"started": False, "error": (lines[-1] if lines else str(exc)[-500:]).strip()}
    try:
        t0 = time.perf_counter()
        figures = run_bench(server.port, path, args, distribution, scratch / f"{arm}-{distribution}.jsonl", scratch)
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
        figures["server_alive"] = server.proc.poll() is None
        if figures["server_alive"] and arm != "plain":
            stats = server.stats()
            figures["kvx"] = {key: stats.get(key) for key in ("compactions_done", "auto_contexts_queued", "contexts_evicted",
                                                              "host_restores", "disk_restores", "restore_waits",
                                                              "restore_failures")}
        return figures
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", choices=("tiny-llama", "smollm2"))
    parser.add_argument("--arms", default="plain,auto,host,disk")
    parser.add_argument("--distributions", default="uniform,zipf")
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--prompts-per-group", type=int, default=4)
    parser.add_argument("--system-prompt-len", type=int, default=1850)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pool", type=int, default=12288)
    parser.add_argument("--policy", default="keydiff")
    parser.add_argument("--keep-fraction", type=float, default=0.1)
    parser.add_argument("--auto-min-tokens", type=int, default=512)
    parser.add_argument("--host-store-gb", type=float, default=1.0)
    parser.add_argument("--zipf-alpha", type=float, default=1.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    path = model_path(args.model)
    arms = args.arms.split(",")
    result: dict = {"model": args.model, "pool_tokens": args.pool, "workload": {
        key: getattr(args, key) for key in ("groups", "prompts_per_group", "system_prompt_len", "question_len",
                                            "output_len", "concurrency", "policy", "keep_fraction", "seed")},
        "load_average": os.getloadavg(), "runs": {}}
    for distribution in args.distributions.split(","):
        with tempfile.TemporaryDirectory(prefix="kvx-bench-serving-") as scratch:
            runs = {arm: one_arm(arm, path, args, distribution, Path(scratch)) for arm in arms}
        plain = runs.get("plain", {})
        for arm, figures in runs.items():
            if arm == "plain" or not plain.get("request_throughput") or not figures.get("request_throughput"):
                continue
            figures["over_plain"] = {
                "request_throughput": round(figures["request_throughput"] / plain["request_throughput"], 3),
                "output_throughput": round(figures["output_throughput"] / plain["output_throughput"], 3),
                "median_ttft": round(figures["median_ttft_ms"] / plain["median_ttft_ms"], 3),
                "median_tpot": round(figures["median_tpot_ms"] / plain["median_tpot_ms"], 3)}
            if figures.get("outputs") and plain.get("outputs"):
                same = sum(a == b for a, b in zip(figures["outputs"], plain["outputs"]))
                figures["answers_equal_to_plain"] = f"{same}/{len(plain['outputs'])}"
        for figures in runs.values():
            figures.pop("outputs", None)
        result["runs"][distribution] = runs
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
