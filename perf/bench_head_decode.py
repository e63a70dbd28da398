"""Online H2O and KeyDiff served as decode steps: their decode-step cost against plain decoding (issue 15).

    OMP_NUM_THREADS=1 python perf/bench_head_decode.py [--cell sigmoid-nope-none] [--prompt 384]
        [--new-tokens 512] [--budget 64] [--repeats 3]

One real server (``--kvx-decode-steps on``, the ``kvx_gated`` backend) serving a dense cell of the
learned-gate family, where the paper runs its post-hoc baselines. A real-text prompt from the
cell's test split, greedy, under three arms interleaved over ``--repeats``: ``plain`` (no decode
step), ``h2o`` and ``keydiff`` (``--budget`` entries per layer and head). Per-step decode time from
the streamed response (``bench_oda``'s timing); the pool's peak used KV bytes while each ran (per-head
eviction masks entries, it does not return slots: every head's key shares one slot) and each
request's report. Prints one JSON object; ratios are measured in one run.

``--url URL`` runs the arms on a server already running, as ``bench_gate_decode.run_arms`` checks and
uses it (the cell served, decode steps on, no default step, the context; ``perf/served.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
from pathlib import Path

from bench_gate_decode import run_arms  # perf/ is on the path when run as a script

from sglang_kvx.eval.gate_eviction import split_windows
from sglang_kvx.serve.launcher import add_url_option, urls_from_args

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="sigmoid-nope-none", help="a dense cell under weights/gated (default: sigmoid-nope-none)")
    parser.add_argument("--prompt", type=int, default=384, help="prompt tokens (default: 384)")
    parser.add_argument("--new-tokens", type=int, default=512, help="tokens generated per request (default: 512)")
    parser.add_argument("--budget", type=int, default=64, help="entries per layer and head (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three arms (default: 3)")
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    path = ROOT / "weights" / "gated" / args.cell
    prompt = split_windows(path, "test", length=args.prompt, limit=1)[0].tolist()
    arms = {"plain": None, "h2o": {"step": "h2o", "budget": args.budget},
            "keydiff": {"step": "keydiff", "budget": args.budget}}
    times, reports, peaks, _ = run_arms(path, prompt, arms, args.new_tokens, args.repeats, url)
    median = {arm: statistics.median(values) for arm, values in times.items()}
    print(json.dumps({
        "cell": args.cell, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "budget": args.budget,
        "repeats": args.repeats, "decode_seconds_per_step": median, "all_runs": times,
        "h2o_vs_plain": median["h2o"] / median["plain"], "keydiff_vs_plain": median["keydiff"] / median["plain"],
        "reports": {arm: reports[arm] for arm in ("h2o", "keydiff")},
        "pool_bytes_peak": peaks,
    }, indent=2))


if __name__ == "__main__":
    main()
