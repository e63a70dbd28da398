"""How often decoding on ODA's quality suite needs Full attention: the per-step oracle route (seed 003).

    OMP_NUM_THREADS=1 python perf/bench_oda_oracle.py [--model tiny-hybrid-deep] [--length 2048]
        [--tasks niah_single_1,niah_single_2,niah_single_3,niah_multiquery,niah_multivalue,vt]
        [--samples 4] [--seed 0] [--sinks 4] [--window 128] [--max-new-tokens 24] [--out FILE]

No server: the HF oracle (``sglang_kvx.reference.oda``, float32, one thread) on the samples
``perf/bench_oda_quality.py`` sends (``generate_sample(task, length, seed, index=i)``, prompt =
context + question, tokenised as the server's /generate does: the tokenizer's default special
tokens, ``HFReference.encode``), greedy, stopping after ``--max-new-tokens`` outputs or after a token
the server stops on (config / generation_config ``eos_token_id`` and the tokenizer's EOS). Routes:
  - ``full``: every routed step Full, with each step's Local counterfactual computed from the same
    pre-step state (``oracle_generate(commit="full")``); a step "needs Full" where Local's argmax
    differs from Full's;
  - ``local``: every routed step Local (s sinks + the w most recent keys);
  - ``oracle``: both branches at every step, committing Local's (cache and logits) where its argmax
    equals Full's and Full's otherwise (``oracle_generate``): the cheapest per-step rule that never
    commits a token Full would not have chosen from the same state. Its Full-call rate is the
    natural floor for a router meant to reproduce Full's answers, not a strict bound on every router
    (another schedule reaches other states, and an answer can score like Full with other tokens).
    Its answers can still leave Full's: a Local-committed step stores KV computed under Local
    attention, and later Full steps read it (``same_tokens_as_full`` counts the samples that match).
Steps are counted as the server counts them (``sglang_kvx/reference/oda.py``): the prefill (Full)
produces output 1, routed step t produces output t + 1, so N outputs take N - 1 routed steps.
Scores are RULER's metric x 100 averaged over all samples (as bench_oda_quality); the Full-call rate
is pooled (Full steps / routed steps over the suite) and, as bench_oda_quality reports it, the mean
of the per-request rates. ``need_full`` reports, along the Full trajectory, the share of routed steps
that need Full per task and by step index, and each sample's trace. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sglang_kvx.eval.scoring import METRICS, postprocess
from sglang_kvx.eval.tasks import generate_sample
from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.reference import oda
from sglang_kvx.reference.hf import HFReference

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multiquery,niah_multivalue,vt"


def truncate(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1]
    return tokens


def rate(full: int, routed: int) -> float | None:
    return round(full / routed, 4) if routed else None


def summarise(records: list[dict[str, Any]], arm: str, tasks: list[str]) -> dict[str, Any]:
    scores = [r[arm]["score"] for r in records]
    per_task = {t: round(100 * sum(v) / len(v), 2) for t in tasks
                if (v := [r[arm]["score"] for r in records if r["task"] == t])}
    full_steps = sum(r[arm]["full_steps"] for r in records)
    routed = sum(r[arm]["routed_steps"] for r in records)
    rates = [r[arm]["full_steps"] / r[arm]["routed_steps"] if r[arm]["routed_steps"] else 0.0 for r in records]
    return {"score": round(100 * sum(scores) / len(scores), 2), "per_task": per_task,
            "full_rate": rate(full_steps, routed), "full_rate_request_mean": round(sum(rates) / len(rates), 4),
            "full_steps": full_steps, "routed_steps": routed,
            "stopped_at_eos": sum(r[arm]["eos"] for r in records),
            "seconds_per_sample": round(sum(r[arm]["seconds"] for r in records) / len(records), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid-deep",
                        help="model folder under weights/, or a path starting with / or .")
    parser.add_argument("--length", type=int, default=2048, help="tokens per prompt (the suite's target length)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated suite tasks")
    parser.add_argument("--samples", type=int, default=4, help="samples per task (indices 0..n-1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="suite seed (0: bench_oda_quality's; 100: train_recall_head's suite check)")
    parser.add_argument("--sinks", type=int, default=4, help="Local attention's sink tokens")
    parser.add_argument("--window", type=int, default=128, help="Local attention's window (current token included)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="most output tokens per answer")
    parser.add_argument("--no-eos-stop", action="store_true",
                        help="always decode --max-new-tokens (train_recall_head's suite check does), "
                             "instead of stopping at EOS as the server does")
    parser.add_argument("--out", default="", help="also write the JSON object to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    ensure_demo_models()
    path = weights_root() / args.model if not args.model.startswith(("/", ".")) else Path(args.model)
    ref = HFReference(path)
    stops = set() if args.no_eos_stop else ref.stop_ids()
    tasks = [t for t in args.tasks.split(",") if t]
    work = [(task, i) for task in tasks for i in range(args.samples)]
    records: list[dict[str, Any]] = []
    decode = lambda tokens: ref.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731

    for task, index in tqdm(work, desc=f"{Path(path).name}@{args.length}", unit="sample"):
        sample = generate_sample(task, args.length, seed=args.seed, index=index, tokenizer=ref.tokenizer)
        ids = ref.encode(sample.context + sample.question)
        record: dict[str, Any] = {"task": task, "index": index, "prompt_tokens": len(ids), "answers": sample.answers}

        def arm(name: str, tokens: list[int], full_steps: list[bool], seconds: float) -> None:
            text = decode(tokens)
            record[name] = {"text": text, "score": METRICS[task](postprocess(text), sample.answers),
                            "tokens": len(tokens), "routed_steps": len(tokens) - 1, "full_steps": sum(full_steps),
                            "eos": bool(tokens) and tokens[-1] in stops, "seconds": round(seconds, 3)}

        t0 = time.perf_counter()
        full = oda.oracle_generate(ref, ids, args.max_new_tokens, args.sinks, args.window, commit="full",
                                   stop_ids=stops)
        arm("full", full.tokens, full.full_steps, time.perf_counter() - t0)
        record["need_full"] = "".join("F" if d else "." for d in full.disagree)  # per routed step
        record["full_pieces"] = [decode([t]) for t in full.tokens]  # output t+1 is what step t produced

        t0 = time.perf_counter()
        local = oda.oda_generate(ref, ids, args.max_new_tokens, args.sinks, args.window, oda.always_local)
        tokens = truncate(local.tokens, stops)
        arm("local", tokens, local.full_steps[:len(tokens) - 1], time.perf_counter() - t0)

        t0 = time.perf_counter()
        oracle = oda.oracle_generate(ref, ids, args.max_new_tokens, args.sinks, args.window, stop_ids=stops)
        arm("oracle", oracle.tokens, oracle.full_steps, time.perf_counter() - t0)
        record["oracle"]["schedule"] = "".join("F" if f else "." for f in oracle.full_steps)
        record["oracle"]["same_tokens_as_full"] = oracle.tokens == full.tokens
        records.append(record)

    arms = {name: summarise(records, name, tasks) for name in ("full", "local", "oracle")}
    full_score, local_score = arms["full"]["score"], arms["local"]["score"]
    gap = full_score - local_score
    arms["oracle"]["gap_recovered"] = round((arms["oracle"]["score"] - local_score) / gap, 4) if gap else None
    arms["oracle"]["same_tokens_as_full"] = sum(r["oracle"]["same_tokens_as_full"] for r in records)
    arms["oracle"]["meets_paper_target"] = bool(
        gap and arms["oracle"]["gap_recovered"] >= 0.9 and arms["oracle"]["full_rate"] <= 0.5)

    need_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    need_step: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        for step, mark in enumerate(r["need_full"], start=1):
            need_task[r["task"]][0] += mark == "F"
            need_task[r["task"]][1] += 1
            need_step[step][0] += mark == "F"
            need_step[step][1] += 1
    need = sum(v[0] for v in need_task.values())
    routed = sum(v[1] for v in need_task.values())
    result: dict[str, Any] = {
        "model": Path(path).name, "length": args.length, "tasks": tasks, "samples_per_task": args.samples,
        "seed": args.seed, "sinks": args.sinks, "window": args.window, "max_new_tokens": args.max_new_tokens,
        "stop_ids": sorted(stops), "dtype": "float32", "arms": arms, "full_minus_local": round(gap, 2),
        "need_full": {
            "what": "along the full trajectory: routed steps where Local's argmax differs from Full's",
            "fraction": rate(need, routed), "steps": routed, "need_full": need,
            "per_task": {t: {"fraction": rate(*need_task[t]), "need_full": need_task[t][0], "steps": need_task[t][1]}
                         for t in tasks if t in need_task},
            "by_step": [{"step": s, "fraction": rate(*need_step[s]), "need_full": need_step[s][0],
                         "steps": need_step[s][1]} for s in sorted(need_step)],
        },
        "samples": records,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "command": "python perf/bench_oda_oracle.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
            for k, v in vars(args).items() if v is not False and v != ""),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
