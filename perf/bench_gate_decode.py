"""Learned-gate eviction served: decode-step cost and live KV during a long generation (issue 15).

    OMP_NUM_THREADS=1 python perf/bench_gate_decode.py [--cell sigmoid-nope-gate] [--prompt 384]
        [--new-tokens 2048] [--repeats 3] [--tau TAU]

One real server (``--kvx-decode-steps on``, the ``kvx_gated`` backend, context stretched to fit the
generation) serving one gated cell. A real-text prompt from the cell's test split, greedy, generated
under three arms, interleaved over ``--repeats``:
  - ``plain``: no decode step;
  - ``gate_tau0``: the ``sigmoid-gate`` step at tau = 0 (its bookkeeping, nothing deleted);
  - ``gate``: the step at ``--tau`` (default: the checkpoint's frozen tau*).
Per-step decode time comes from the streamed response (first to last token over the tokens between).
Memory: the request's own report (live entries per layer after the last step; deleted entries), the
pool's used KV bytes sampled from ``/kvx/stats`` during the generation (physical: what the pool
holds), and the logical live bytes the deletions leave, against the theoretical (1 - deletion rate).
Prints one JSON object; ratios are measured in one run.

``--url URL`` runs the arms on a server already running (used as launched, flushed before each arm):
it must serve the cell with decode steps on, no default step (``plain`` is plain decoding) and a
context of the prompt plus the generation; the memory figures are its pool's (``perf/served.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
import threading
from pathlib import Path

import requests
from bench_oda import decode_seconds_per_step  # perf/ is on the path when run as a script

from sglang_kvx.config import read_gate_tau
from sglang_kvx.eval.gate_eviction import split_windows
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]


def stream(url: str, body: dict) -> tuple[float, dict, int]:
    """Seconds per decode step and the last chunk (``bench_oda``'s streamed timing), and the most KV
    bytes the pool held while the request ran (sampled every 0.2 s)."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], requests.get(url + "/kvx/stats", timeout=10).json()["kv_bytes_used"])
            except requests.RequestException:
                pass
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        seconds, last = decode_seconds_per_step(url, body)
    finally:
        done.set()
        sampler.join()
    return seconds, last, peak[0]


def run_arms(path: Path, prompt: list[int], arms: dict[str, dict | None], new_tokens: int,
             repeats: int, url: str | None = None) -> tuple[dict[str, list[float]], dict, dict[str, int], dict]:
    """One server (``--kvx-decode-steps on``, context stretched to fit; or the one at ``url``, checked
    to serve the same); each arm's decode step (None: plain) greedy over ``prompt``, the arms
    interleaved over ``repeats`` rounds, the prefix cache flushed before each. Returns each arm's
    seconds per step per round, its last report, the pool's peak used KV bytes while it ran, and the
    server's final ``/kvx/stats``."""
    context = len(prompt) + new_tokens + 8
    if url:
        served = describe(url)
        served.require_model(path)
        served.require_plain_decoding()
        served.require_context(context, f"a {len(prompt)}-token prompt and {new_tokens} new tokens")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    reports, peaks = {}, {}
    with server_or_url(url, path, "--dtype", "float32", "--kvx-decode-steps", "on", "--context-length", str(context),
                       max_total_tokens=2 * context, env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}) as server:
        for _ in range(repeats):
            for arm, decode in arms.items():
                server.flush()
                sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
                if decode is not None:
                    sampling["custom_params"] = {"kvx": {"decode": decode}}
                seconds, last, peak = stream(server.url, {"input_ids": prompt, "sampling_params": sampling})
                times[arm].append(seconds)
                reports[arm] = (last["meta_info"].get("kvx") or [None])[-1]
                peaks[arm] = max(peaks.get(arm, 0), peak)
        return times, reports, peaks, server.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="sigmoid-nope-gate", help="a gated cell under weights/gated (default: sigmoid-nope-gate)")
    parser.add_argument("--prompt", type=int, default=384, help="prompt tokens (default: 384)")
    parser.add_argument("--new-tokens", type=int, default=2048, help="tokens generated per request (default: 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three arms (default: 3)")
    parser.add_argument("--tau", type=float, default=None, help="threshold of the 'gate' arm (default: the checkpoint's tau*)")
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    path = ROOT / "weights" / "gated" / args.cell
    tau = args.tau if args.tau is not None else read_gate_tau(path)
    if tau is None:
        raise SystemExit(f"{path} has no frozen tau; pass --tau or run perf/bench_gate_eviction.py --write-tau")
    prompt = split_windows(path, "test", length=args.prompt, limit=1)[0].tolist()
    arms = {"plain": None, "gate_tau0": {"step": "sigmoid-gate", "tau": 0.0}, "gate": {"step": "sigmoid-gate", "tau": tau}}
    times, reports, peaks, stats = run_arms(path, prompt, arms, args.new_tokens, args.repeats, url)
    bytes_per_entry = stats["kv_bytes_total"] // stats["kv_pool_total_tokens"]  # one position, all layers
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    cached = args.prompt + args.new_tokens - 1
    report = reports["gate"]
    live_entries = cached + sum(report["live_entries_per_layer"].values())  # layer 0 keeps all
    deletion_rate = 1 - live_entries / (cached * layers)
    median = {arm: statistics.median(values) for arm, values in times.items()}
    result = {
        "cell": args.cell, "tau": tau, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "decode_seconds_per_step": median, "all_runs": times,
        "gate_vs_plain": median["gate"] / median["plain"], "gate_vs_tau0": median["gate"] / median["gate_tau0"],
        "tau0_vs_plain": median["gate_tau0"] / median["plain"],
        "gate_report": report,
        "memory": {
            "pool_bytes_peak": peaks,  # physical: the pool's used KV bytes while the request ran
            "logical_live_bytes": {"plain": cached * bytes_per_entry, "gate": live_entries * bytes_per_entry // layers},
            "deletion_rate": deletion_rate,
            "theoretical_live_fraction": 1 - deletion_rate,
            "note": "deleted entries leave attention at once; every 64 decode steps the row's own stretch is "
                    "re-folded and the cells its deleted entries held go back to the pool; the prompt's entries stay "
                    "where the prefix cache holds them (shared), and up to 64 steps' entries wait for the next fold",
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
