"""GateSight's layer allocation on a validation split: per-layer budgets, needle retention per layer
and suite accuracy for gate-proportional budgets, floors under them, an exponent, and flat budgets.

    OMP_NUM_THREADS=1 python perf/bench_allocation.py [--seed 200] [--samples 10] \\
        [--arms gate,flat,floor0.5,floor0.75,floor0.9,exp0.5] [--fractions 0.1,0.05,0.02] [--out FILE]

Offline, through the HF oracle (the server's children equal it token for token, tests/
test_compaction_e2e.py): for each generated 2K-token context one prefill gives the signals, GateSight's
estimators score it once, and each arm's budgets (``allocate.layer_budgets``; ``floorF`` = the
``gate`` allocation with every layer first given F x the flat budget, ``expE`` = gate weights to
the power E) select a keep-set; the question is answered greedily from each compacted cache and
scored with RULER's metrics. Also per arm and fraction: the mean budget per attention layer and the
share of the queried needles' value entries kept per layer (needle tasks). The served ablation on
other seeds is ``python -m sglang_kvx.eval --policies gatesight@gate,gatesight,...``. Prints one JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_kvx.allocate import layer_budgets
from sglang_kvx.eval.retention import needle_spans, retention
from sglang_kvx.eval.scoring import METRICS, postprocess
from sglang_kvx.eval.tasks import generate_sample
from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.policies import get_policy
from sglang_kvx.select.keep_set import select_keep_set

TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multiquery,niah_multivalue,vt,qa_2"


def arm_budget_rule(arm: str) -> tuple[str, dict]:
    """'gate' | 'flat' | 'pyramidkv' | 'floorF' | 'expE' -> (allocation, options)."""
    if arm.startswith("floor"):
        return "gate", {"floor": float(arm[len("floor"):])}
    if arm.startswith("exp"):
        return "gate", {"exponent": float(arm[len("exp"):])}
    return arm, {}


def measure(model: str, tasks: list[str], samples: int, seed: int, arms: list[str], fractions: list[float],
            max_new_tokens: int = 32) -> dict:
    from sglang_kvx.reference.hf import HFReference
    from sglang_kvx.reference.signals import context_signals

    ref = HFReference(model)
    policy = get_policy("gatesight")(model_path=model)
    scores: dict[tuple, list[float]] = defaultdict(list)
    budgets: dict[tuple, list[list[int]]] = defaultdict(list)
    kept: dict[tuple, list[list[float]]] = defaultdict(list)
    with torch.no_grad():
        for task in tasks:
            for index in tqdm(range(samples), desc=task, dynamic_ncols=True):
                sample = generate_sample(task, 2048, seed=seed, index=index, tokenizer=ref.tokenizer)
                ids = ref.tokenizer(sample.context).input_ids
                question = ref.tokenizer(sample.question, add_special_tokens=False).input_ids
                spans = needle_spans(sample, ref.tokenizer) if task.startswith("niah") else []
                signals = context_signals(ref, ids)
                utility = policy.score_layers(signals)
                whole = [torch.arange(len(ids)).expand(signals.num_kv_heads, -1) for _ in range(signals.num_layers)]
                cells = [("full", 1.0, whole)]
                for arm in arms:
                    allocation, options = arm_budget_rule(arm)
                    for p in fractions:
                        b = layer_budgets(allocation, p, signals.n, signals.num_layers, signals, **options)
                        keep = select_keep_set(utility, b, 0)
                        budgets[(arm, p)].append(b)
                        if spans:
                            kept[(arm, p)].append(retention(keep, spans)[2])
                        cells.append((arm, p, keep.positions))
                for arm, p, positions in cells:
                    answer = ref.tokenizer.decode(ref.compacted_greedy(ids, positions, question, max_new_tokens),
                                                  skip_special_tokens=True)
                    scores[(arm, p, task)].append(METRICS[task](postprocess(answer), sample.answers))
    rows = []
    for (arm, p), per_task in _group(scores).items():
        row = {"arm": arm, "keep_fraction": p,
               "score": round(100 * sum(sum(v) / len(v) for v in per_task.values()) / len(per_task), 2),
               "per_task": {t: round(100 * sum(v) / len(v), 1) for t, v in per_task.items()}}
        if (arm, p) in budgets:
            b = budgets[(arm, p)]
            row["mean_budget_per_layer"] = [round(sum(x[l] for x in b) / len(b), 1) for l in range(len(b[0]))]
        if kept.get((arm, p)):
            k = kept[(arm, p)]
            row["needle_value_entries_kept_per_layer"] = [round(100 * sum(x[l] for x in k) / len(k), 1) for l in range(len(k[0]))]
        rows.append(row)
    return {"model": Path(model).name, "seed": seed, "samples": samples, "tasks": tasks, "rows": rows}


def _group(scores: dict[tuple, list[float]]) -> dict[tuple, dict[str, list[float]]]:
    grouped: dict[tuple, dict[str, list[float]]] = defaultdict(dict)
    for (arm, p, task), values in scores.items():
        grouped[(arm, p)][task] = values
    return grouped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hybrid model path (default: the embedded demo hybrid)")
    parser.add_argument("--tasks", default=TASKS, help="comma-separated suite tasks (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=10, help="contexts per task (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=200, help="suite seed: the validation split (default: %(default)s)")
    parser.add_argument("--arms", default="gate,flat,floor0.5,floor0.75,floor0.9,exp0.5",
                        help="budget rules: gate, flat, pyramidkv, floorF, expE (default: %(default)s)")
    parser.add_argument("--fractions", default="0.1,0.05,0.02", help="keep fractions (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length (default: %(default)s)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    ensure_demo_models()
    torch.set_num_threads(1)
    model = args.model or str(weights_root() / DEFAULT_MODEL)
    result = measure(model, [t for t in args.tasks.split(",") if t], args.samples, args.seed,
                     [a for a in args.arms.split(",") if a], [float(f) for f in args.fractions.split(",") if f],
                     args.max_new_tokens)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
