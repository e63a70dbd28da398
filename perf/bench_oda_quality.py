"""On-Demand Attention's answer quality at matched Full-call rates (seed 003, Table 1's protocol).

    OMP_NUM_THREADS=1 python perf/bench_oda_quality.py [--model tiny-hybrid-deep] [--length 2048]
        [--tasks niah_single_1,niah_single_2] [--samples 16] [--sinks 4] [--window 128] [--thetas 0]

One real server with decode steps on and the recall head trained for the model. Every sample of
the evaluation suite (``sglang_kvx.eval.tasks``, seed 0: the test split the head's training never
saw — its manifest records the seeds it used) is answered greedily under:
  - ``full``: plain decoding;
  - ``local``: Local attention at every step (``span_schedule`` that never re-runs);
  - ``oda@theta``: the recall head routing at each ``--thetas`` value;
  - ``random@theta``: chance routing (``random_route``) at the Full-call rate ODA realised at that
    theta, over the same samples.
The prefill is Full in every arm (the paper's handoff), so arms differ from the second answer token
on. Prints one JSON object: per arm the suite's score (RULER metric x 100), the realised Full-call
rate, and for ODA the share of the Full-Local gap it recovers ((oda - local) / (full - local)).

``--url URL`` runs against a server already running (used as launched): it must serve the model,
decode steps on and no default step (``full`` is plain decoding), a context of ``--length`` + 256
and a recall head, whose folder (its ``--kvx-oda-head``, else the one found for its model) is then
the head reported (``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import requests
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_kvx.eval.scoring import METRICS, postprocess
from sglang_kvx.eval.tasks import generate_sample
from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

NEVER = 1 << 24


def answer(url: str, text: str, decode: dict | None, max_new_tokens: int) -> tuple[str, dict]:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    if decode is not None:
        sampling["custom_params"] = {"kvx": {"decode": decode}}
    response = requests.post(url + "/generate", json={"text": text, "sampling_params": sampling}, timeout=600)
    response.raise_for_status()
    body = response.json()
    return body["text"], (body["meta_info"].get("kvx") or [{}])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid-deep")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--thetas", default="0")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--head", default="", help="recall head folder (default: the one trained for the model)")
    parser.add_argument("--seed", type=int, default=0,
                        help="suite seed (default 0, the test split; a head's held-out seed, 3000001, compares "
                             "training recipes without reading the test split)")
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    ensure_demo_models()
    path = weights_root() / args.model if not args.model.startswith(("/", ".")) else args.model
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tasks = [t for t in args.tasks.split(",") if t]
    samples = [(task, generate_sample(task, args.length, seed=args.seed, index=i, tokenizer=tokenizer))
               for task in tasks for i in range(args.samples)]
    span = {"sinks": args.sinks, "window": args.window}
    thetas = [float(t) for t in args.thetas.split(",") if t]
    head = args.head or "the model's trained head"
    if url:  # the server's own head routes
        served = describe(url)
        served.require_model(path)
        served.require_plain_decoding()
        served.require_context(args.length + 256, f"a {args.length}-token prompt and its answer")
        if not served.oda_head:
            served.refuse("it serves no recall head (--kvx-oda-head): the oda arms need one")
        if args.head and Path(args.head).resolve() != Path(served.oda_head).resolve():
            parser.error(f"--head {args.head}: the server at {url} serves the head in {served.oda_head} (drop --head)")
        head = served.oda_head
    extra = ("--kvx-oda-head", args.head) if args.head else ()
    server = server_or_url(url, path, "--kvx-decode-steps", "on", *extra, "--context-length", str(args.length + 256),
                           max_total_tokens=4 * (args.length + 256))
    scores: dict[str, list[float]] = defaultdict(list)
    rates: dict[str, list[float]] = defaultdict(list)

    def run_arm(name: str, decode: dict | None) -> None:
        for task, sample in tqdm(samples, desc=name, leave=False):
            text, report = answer(server.url, sample.context + sample.question, decode, args.max_new_tokens)
            scores[name].append(METRICS[task](postprocess(text), sample.answers))
            if "full_rate" in report:
                rates[name].append(report["full_rate"])

    try:
        server.start()
        run_arm("full", None)
        run_arm("local", {"step": "span_schedule", **span, "full_every": NEVER})
        for theta in thetas:
            run_arm(f"oda@{theta:g}", {"step": "oda", **span, "theta": theta})
            rate = sum(rates[f"oda@{theta:g}"]) / max(1, len(rates[f"oda@{theta:g}"]))
            run_arm(f"random@{theta:g}", {"step": "random_route", **span, "rate": round(rate, 6), "seed": 1})
            rates[f"random@{theta:g}"] = [rate]  # its expected rate (draws per step; not reported per request)
    finally:
        server.stop()
    result: dict = {"model": args.model, "length": args.length, "seed": args.seed, "tasks": tasks,
                    "samples_per_task": args.samples, "head": head,
                    "sinks": args.sinks, "window": args.window, "arms": {}}
    for name, values in scores.items():
        result["arms"][name] = {"score": round(100 * sum(values) / len(values), 2),
                                **({"full_rate": round(sum(rates[name]) / len(rates[name]), 4)} if rates[name] else {})}
    full, local = result["arms"]["full"]["score"], result["arms"]["local"]["score"]
    result["full_minus_local"] = round(full - local, 2)
    for theta in thetas:
        arm = result["arms"][f"oda@{theta:g}"]
        arm["gap_recovered"] = round((arm["score"] - local) / (full - local), 4) if full != local else None
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
