"""Where the learned head loses answers, and a Local-confidence guard tried against it.

    OMP_NUM_THREADS=1 python perf/oda_local_guard.py --model weights/smollm2-135m-instruct \\
        --seed 3000001 --arms full,local,head,guard:0.25 --lost-steps

Closed loop with the HF oracle (``sglang_kvx.reference.oda.oda_generate``, which the server matches
token for token), stopping at EOS as the server does, on the evaluation suite at ``--seed`` (3000001: the heads' held-out split; 0: the
test split). Arms: ``full``, ``local``, ``head`` (the recall head at theta 0) and ``guard:P`` (the
head, and also Full wherever Local's own top-1 probability is below P: a rule of ours, not the
paper's). Prints one JSON object: per arm the score x 100, the realised Full rate and the share of
the Full-Local gap (when both ran). With ``--lost-steps`` (needs full and head): per prompt the head
scores lower than Full, ``lost_steps`` names the first step where the two outputs differ, whether the head sent it Local, its
score there and Local's top-1 probability there (against the median over the head's Local steps).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sglang_kvx.decode.recall_head import RecallHead
from sglang_kvx.reference import oda
from sglang_kvx.reference.hf import HFReference
from sglang_kvx.training import train_recall_head as T

SMOLLM2_TASKS = "niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multiquery,niah_multivalue,vt,cwe,fwe,qa_2"


def local_top1(ref: HFReference, local_h: torch.Tensor) -> float:
    """Local's probability of its own greedy token (its logits, recomputed from the final hidden)."""
    lm_head = ref.model.lm_head
    return float(torch.softmax(lm_head(local_h.to(lm_head.weight.dtype)).float(), -1).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="weights/smollm2-135m-instruct")
    p.add_argument("--head", default="", help="recall head folder (default: weights/oda/<model name>)")
    p.add_argument("--tasks", default=SMOLLM2_TASKS)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=3000001)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--arms", default="full,local,head,guard:0.25")
    p.add_argument("--lost-steps", action="store_true")
    args = p.parse_args()
    if args.lost_steps and not {"full", "head"} <= set(args.arms.split(",")):
        p.error("--lost-steps needs the full and head arms")
    torch.set_num_threads(1)
    ref = HFReference(args.model)
    head = RecallHead.from_pretrained(args.head or f"weights/oda/{Path(args.model).name}", args.model)
    prompts = T.suite_prompts(ref, args.tasks.split(","), args.samples, args.length, args.seed)

    def route_for(arm: str, trace: list[dict] | None = None) -> oda.Route:
        if arm in ("full", "local"):
            return oda.always_full if arm == "full" else oda.always_local
        p_min = float(arm.split(":")[1]) if arm.startswith("guard:") else None
        if p_min is None and arm != "head":
            raise SystemExit(f"unknown arm {arm!r}: full, local, head or guard:P")
        scores: list[float] = []
        head_route = oda.head_route(head, 0.0, scores)

        def route(step: int, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor) -> bool:
            full = head_route(step, prev_h, emb, local_h)
            p_top = local_top1(ref, local_h) if (p_min is not None or trace is not None) else None
            full = full or (p_min is not None and p_top < p_min)
            if trace is not None:
                trace.append({"step": step, "full": full, "score": scores[-1], "local_top1": p_top})
            return full
        return route

    runs: dict[str, list[T.SuiteAnswer]] = {}
    traces: list[list[dict]] = [[] for _ in prompts]  # the head arm's per-step record, per prompt
    result: dict = {"model": Path(args.model).name, "seed": args.seed, "samples_per_task": args.samples,
                    "length": args.length, "sinks": args.sinks, "window": args.window, "arms": {}}
    for arm in args.arms.split(","):
        routes = [route_for(arm, trace if args.lost_steps and arm == "head" else None) for trace in traces]
        runs[arm] = T.generate_arm(ref, prompts, routes, args.new_tokens, args.sinks, args.window, desc=arm)
        result["arms"][arm] = {"score": 100 * statistics.mean(a.score for a in runs[arm]),
                               "full_rate": T.mean_full_rate(runs[arm])}
    if "full" in runs and "local" in runs:
        full, local = result["arms"]["full"]["score"], result["arms"]["local"]["score"]
        for row in result["arms"].values():
            row["gap_share"] = (row["score"] - local) / (full - local) if full != local else None

    if args.lost_steps:
        result["lost_steps"] = []
        for k, (f, h, trace) in enumerate(zip(runs["full"], runs["head"], traces)):
            if h.score >= f.score:
                continue
            f_tokens, h_tokens = f.result.tokens, h.result.tokens
            d = next((i for i, (a, b) in enumerate(zip(f_tokens, h_tokens)) if a != b),
                     min(len(f_tokens), len(h_tokens)))  # or where the shorter one stopped
            local_p = [t["local_top1"] for t in trace if not t["full"]]
            result["lost_steps"].append({
                "prompt": k, "task": h.task, "full_score": f.score, "head_score": h.score,
                "first_differing_token": d, "that_step": trace[d - 1] if 1 <= d <= len(trace) else None,  # token d: step d
                "median_local_top1_on_local_steps": statistics.median(local_p) if local_p else None})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
