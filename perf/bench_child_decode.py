"""A compacted child's decode step against a plain row holding as many KV entries (issue #56 item 6).

    OMP_NUM_THREADS=1 python perf/bench_child_decode.py [--context 4096] [--rows 8] [--new-tokens 128]
        [--repeats 2] [--models tiny-llama,tiny-hybrid-deep]

Per model one real server; per kind ``--rows`` requests at once (one decode batch), each streamed:
its decode seconds per step are measured over the stretch in which every row of the batch decodes
(after the last row's first token, before the first row's last: no row's prefill runs beside them),
as the stretch's length over the steps the row took in it; the batch's figure the median over its
rows, the kind's the smallest over ``--repeats`` rounds (kinds interleaved within a round). Kinds, on tiny-llama (KeyDiff, p = 0.5):
``flat``, ``pyramidkv`` and ``global`` children of one ``--context``-token parent compacted with
that allocation (S = p x context slots), and ``streamingllm`` rows (a ``--context``-token prompt
decoded under 4 sinks and a window of a quarter of it, 1,024 tokens at 4K); on tiny-hybrid-deep (GateSight, p = 0.2): ``gate``
children. Each against the plain rows that hold the same number of KV entries: ``plain_S`` (S plus
the question's tokens) beside children, ``plain_window`` (sinks plus window) beside StreamingLLM.
``masked_attention_calls``: the attention layer calls of the kind's round that went through masked
attention instead of the backend's kernels (``/kvx/stats``). Prints one JSON object, last, with
``ratio`` (each kind's step time over its plain row's) and ``masked_attention_calls`` per kind.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from bench_oda import prompt  # perf/ is on the path when run as a script

from sglang_kvx.serve.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
QUESTION = 16
SINKS = 4  # StreamingLLM's window: a quarter of the context (1,024 tokens at 4K)
# model -> (server flags, keep fraction, {child kind: allocation})
MODELS = {
    "tiny-llama": (("--kvx-policy", "keydiff", "--kvx-decode-steps", "on"), 0.5,
                   {"flat": "flat", "pyramidkv": "pyramidkv", "global": "global"}),
    "tiny-hybrid-deep": (("--kvx-policy", "gatesight"), 0.2, {"gate": "gate"}),
}


def stream_stamps(url: str, body: dict) -> list[tuple[float, int]]:
    """Stream the request: (time, tokens generated so far) at each streamed chunk."""
    stamps = []
    with requests.post(url + "/generate", json={**body, "stream": True}, timeout=3600, stream=True) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                stamps.append((time.perf_counter(), json.loads(line[5:])["meta_info"]["completion_tokens"]))
    return stamps


def batch_step(server: ServerProcess, bodies: list[dict]) -> float:
    """Decode seconds per step of the rows sent at once, over the stretch in which every row decodes (no
    row's prefill runs beside them): the stretch's length over the steps a row took in it, the median
    over the rows."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        rows = list(pool.map(lambda body: stream_stamps(server.url, body), bodies))
    start, end = max(stamps[0][0] for stamps in rows), min(stamps[-1][0] for stamps in rows)
    steps = []
    for stamps in rows:
        inside = [(t, n) for t, n in stamps if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] == inside[0][1]:
            raise RuntimeError("the rows never decoded together: raise --new-tokens")
        steps.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
    return statistics.median(steps)


def kinds_of(name: str, args, context: list[int]) -> dict[str, tuple[dict | None, list[dict]]]:
    """kind -> (the parent it needs, or None; its rows' request bodies)."""
    _, p, allocations = MODELS[name]
    slots = int(p * args.context)

    def body(ids: list[int], kvx: dict | None) -> dict:
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        if kvx:
            params["custom_params"] = {"kvx": kvx}
        return {"input_ids": ids, "sampling_params": params}

    questions = [prompt(1000 + row, QUESTION, 500) for row in range(args.rows)]
    kinds = {"plain_S": (None, [body(prompt(2000 + row, slots, 500) + q, None) for row, q in enumerate(questions)])}
    for kind, allocation in allocations.items():
        kvx = {"keep_fraction": p, "allocation": allocation}
        parent = {"input_ids": context, "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvx": kvx}}}
        kinds[kind] = (parent, [body(context + q, kvx) for q in questions])
    if name == "tiny-llama":
        window = args.context // 4
        step = {"decode": {"step": "streamingllm", "sinks": SINKS, "window": window}}
        kinds["streamingllm"] = (None, [body(prompt(3000 + row, args.context, 500), step) for row in range(args.rows)])
        kinds["plain_window"] = (None, [body(prompt(4000 + row, SINKS + window, 500), None) for row in range(args.rows)])
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens of the compacted context (default: 4096)")
    parser.add_argument("--rows", type=int, default=8, help="rows decoding as one batch (default: 8)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each row generates (default: 128)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the kinds (default: 2)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    args = parser.parse_args()
    steps: dict[str, list[float]] = {}
    masked: dict[str, int] = {}
    for name in args.models.split(","):
        flags, p, _ = MODELS[name]
        context = prompt(7, args.context, 500)
        length = args.context + QUESTION + args.new_tokens + 8
        with ServerProcess(ROOT / "weights" / name, *flags, "--kvx-keep-fraction", str(p), "--context-length", str(length),
                           max_total_tokens=args.rows * length + 2 * args.context) as server:
            for _ in range(args.repeats):
                for kind, (parent, bodies) in kinds_of(name, args, context).items():
                    if parent is not None:
                        server.generate(parent).raise_for_status()
                    before = server.stats()["masked_attention_calls"]
                    steps.setdefault(f"{name}/{kind}", []).append(batch_step(server, bodies))
                    masked[f"{name}/{kind}"] = server.stats()["masked_attention_calls"] - before
                    server.flush()
    best = {kind: min(values) for kind, values in steps.items()}

    def reference(kind: str) -> str:
        model, what = kind.split("/")
        return f"{model}/plain_window" if what == "streamingllm" else f"{model}/plain_S"

    ratio = {kind: round(best[kind] / best[reference(kind)], 3) for kind in best if "/plain_" not in kind}
    print(json.dumps({"context": args.context, "rows": args.rows, "new_tokens": args.new_tokens, "repeats": args.repeats,
                      "decode_seconds_per_step": best, "all_runs": steps,
                      "masked_attention_calls": {k: v for k, v in masked.items() if "/plain_" not in k},
                      "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
