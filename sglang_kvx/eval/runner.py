"""Sweep policies x kept fractions on a live SGLang server: accuracy against kept fraction.

    python -m sglang_kvx.eval --model weights/tiny-hybrid --tasks niah_single_1,niah_multikey_1 \\
        --length 1024 --samples 8 --policies keydiff,snapkv --fractions 0.9,0.5,0.2,0.1 --out runs/eval

Protocol (the papers'): every method scores the same prefilled parent. For each session the
context is sent once per (policy, fraction) as a prefill-only parent carrying those settings in
``custom_params``; each question is answered greedily as a child of that compacted parent. The
full-cache row is the same context committed uncompacted. Every method keeps the same protected
prefix. Writes results.json, results.csv and accuracy_vs_keep_fraction.png.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from sglang_kvx.policies import get_policy
from sglang_kvx.eval.scoring import METRICS, postprocess
from sglang_kvx.eval.tasks import SESSION_TASKS, TASKS, generate_sample, generate_session
from sglang_kvx.serve.launcher import flush_cache

FULL = "full"


def _generate(url: str, text: str, max_new_tokens: int, kvx: dict[str, Any]) -> dict:
    response = requests.post(
        url + "/generate",
        json={"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "custom_params": {"kvx": kvx}}},
        timeout=600,
    )
    if response.status_code != 200:
        raise RuntimeError(f"server refused a request ({response.status_code}): {response.text[:300]}")
    return response.json()


def _policy_params(method: str) -> dict[str, Any]:
    """"gatesight" -> its own allocation; "gatesight@flat" -> GateSight's scores under the flat allocation."""
    policy, _, allocation = method.partition("@")
    return {"policy": policy, **({"allocation": allocation} if allocation else {})}


def wait_for_second_passes(url: str, timeout: float = 1800.0) -> None:
    """KVzip compacts once its reconstruction passes ran; questions must find the compacted context.
    The scheduler answers ``/kvx/stats`` between forwards: a long pass on a busy CPU can hold the
    answer for minutes, so a slow answer is waited for (up to ``timeout`` in all), not an error."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            if not requests.get(url + "/kvx/stats", timeout=120).json().get("second_passes_pending"):
                return
        except requests.Timeout:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the second passes (KVzip's reconstruction) did not finish in {timeout:.0f} s")
        time.sleep(0.1)


def evaluate(
    url: str,
    tasks: list[str],
    length: int,
    samples: int,
    policies: list[str],
    fractions: list[float],
    questions: int = 1,
    protected_prefix_len: int = 0,
    max_new_tokens: int = 32,
    seed: int = 0,
    tokenizer: Any = None,
) -> list[dict[str, Any]]:
    """One row per (task, policy, keep_fraction): RULER score x 100 over every question."""
    methods = [(FULL, 1.0)] + [(policy, p) for policy in policies for p in fractions]
    totals: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    work = [(task, i) for task in tasks for i in range(samples)]
    for task, index in tqdm(work, desc="sessions", unit="ctx"):
        if task in SESSION_TASKS and questions > 1:
            session = generate_session(task, length, num_questions=questions, seed=seed, index=index, tokenizer=tokenizer)
            context, turns = session.context, [(t.question, t.answers) for t in session.turns]
        else:
            sample = generate_sample(task, length, seed=seed, index=index, tokenizer=tokenizer)
            context, turns = sample.context, [(sample.question, sample.answers)]
        for policy, p in methods:
            kvx = {"compact": False} if policy == FULL else {
                **_policy_params(policy), "keep_fraction": p, "protected_prefix_len": protected_prefix_len}
            _generate(url, context, 0, kvx)  # the parent
            if kvx.get("policy") and get_policy(kvx["policy"]).second_pass:  # KVzip, KVzip+
                wait_for_second_passes(url)
            for question, answers in turns:
                prediction = _generate(url, context + question, max_new_tokens, kvx)["text"]
                totals[(task, policy, p)].append(METRICS[task](postprocess(prediction), answers))
        flush_cache(url)  # every request of this session finished: start the next from an empty pool
    return [
        {"task": task, "length": length, "policy": policy, "keep_fraction": p,
         "score": round(100 * sum(v) / len(v), 2), "questions": len(v)}
        for (task, policy, p), v in sorted(totals.items())
    ]


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[str, float], float]:
    """Mean score over tasks per (policy, keep_fraction)."""
    grouped: dict[tuple[str, float], list[float]] = defaultdict(list)
    for row in rows:
        grouped[(row["policy"], row["keep_fraction"])].append(row["score"])
    return {key: round(sum(v) / len(v), 2) for key, v in sorted(grouped.items())}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per method, one column per task, plus the mean."""
    tasks = sorted({r["task"] for r in rows})
    by_method: dict[tuple[str, float], dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_method[(r["policy"], r["keep_fraction"])][r["task"]] = r["score"]
    lines = ["| policy | p | " + " | ".join(tasks) + " | mean |", "|" + "---|" * (len(tasks) + 3)]
    for (policy, p), scores in sorted(by_method.items(), key=lambda kv: (kv[0][0] != FULL, kv[0][0], -kv[0][1])):
        mean = sum(scores.values()) / len(scores)
        lines.append(f"| {policy} | {p:g} | " + " | ".join(f"{scores.get(t, float('nan')):.1f}" for t in tasks) + f" | {mean:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = summarize(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    full = means.get((FULL, 1.0))
    for policy in sorted({k[0] for k in means if k[0] != FULL}):
        points = sorted((p, s) for (name, p), s in means.items() if name == policy)
        ax.plot([p for p, _ in points], [s for _, s in points], marker="o", label=policy)
    if full is not None:
        ax.axhline(full, color="black", linestyle="--", label="full cache")
    ax.set_xlabel("kept fraction p")
    ax.set_ylabel("mean score (RULER, x100)")
    ax.set_xscale("log")
    fractions = sorted({p for _, p in means})
    ax.set_xticks(fractions, [f"{p:g}" for p in fractions])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "accuracy_vs_keep_fraction.png")


def build_parser() -> argparse.ArgumentParser:
    from sglang_kvx.models.demo import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m sglang_kvx.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None,
                        help="base URL of a running SGLang server with the extension, e.g. http://127.0.0.1:30000 "
                             "(default: none; the runner starts its own on --model)")
    parser.add_argument("--model", default=None,
                        help="model folder for the server the runner starts (default: the embedded demo model, "
                             f"weights/{DEFAULT_MODEL})")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1",
                        help=f"comma-separated suite tasks, of: {', '.join(sorted(TASKS))} (default: %(default)s)")
    parser.add_argument("--length", type=int, default=1024,
                        help="tokens per prompt (context + question), counted with the model's tokenizer "
                             "(default: %(default)s)")
    parser.add_argument("--samples", type=int, default=8,
                        help="contexts per task; each is one session (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=1,
                        help="questions per shared context; above 1, tasks that have a session form ask them all "
                             "of one context (SCBench's shared-context mode) (default: %(default)s)")
    parser.add_argument("--policies", default="random,knorm,streamingllm,keydiff,snapkv,h2o,triattention,gatesight",
                        help="comma-separated policies to sweep; POLICY@ALLOCATION overrides a policy's allocation "
                             "(gatesight@flat, gatesight@pyramidkv); the full cache is always the reference row "
                             "(default: %(default)s)")
    parser.add_argument("--fractions", default="0.9,0.5,0.2,0.1",
                        help="comma-separated kept fractions p in (0, 1] of each context's KV entries, one row per "
                             "policy and p (default: %(default)s)")
    parser.add_argument("--protected-prefix-len", type=int, default=0,
                        help="leading context tokens every compacted context keeps outside the budget "
                             "(default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="most tokens generated per answer, greedy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the generated contexts, questions and answers; the training scripts use "
                             "seeds from 10**6 up, so seeds below that are held out (default: %(default)s)")
    parser.add_argument("--out", default="runs/eval",
                        help="folder for results.json, results.csv and accuracy_vs_keep_fraction.png "
                             "(default: %(default)s)")
    parser.add_argument("--estimator", default=None,
                        help="GateSight estimator folder for the server the runner starts; not with --url "
                             "(default: the one shipped for the model)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.estimator and args.url:
        parser.error("--estimator configures the server the runner starts; a running server (--url) has its own")
    if importlib.util.find_spec("matplotlib") is None:  # the plot comes last: refuse before the sweep
        parser.error("the plot (accuracy_vs_keep_fraction.png) needs matplotlib: pip install 'sglang-kvx[eval]'")

    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(sorted(TASKS))}")
    policies = [p for p in args.policies.split(",") if p]
    fractions = [float(f) for f in args.fractions.split(",") if f]

    def run(url: str, tokenizer) -> list[dict[str, Any]]:
        return evaluate(url, tasks, args.length, args.samples, policies, fractions, args.questions,
                        args.protected_prefix_len, args.max_new_tokens, args.seed, tokenizer)

    from transformers import AutoTokenizer

    if args.url:
        model_path = requests.get(args.url + "/model_info", timeout=30).json()["model_path"]
        rows = run(args.url.rstrip("/"), AutoTokenizer.from_pretrained(model_path))
    else:
        from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
        from sglang_kvx.serve.launcher import ServerProcess

        ensure_demo_models()
        model_path = args.model or str(weights_root() / DEFAULT_MODEL)
        # KVzip's reconstruction pass re-reads the context after it: room for both.
        context_length = (2 if any(p.startswith("kvzip") for p in policies) else 1) * args.length + args.max_new_tokens + 128
        # The server's own policy is irrelevant: every request names its settings.
        estimator = ("--kvx-estimator", args.estimator) if args.estimator else ()
        with ServerProcess(model_path, "--kvx-policy", policies[0].partition("@")[0] if policies else "random",
                           "--context-length", str(context_length), *estimator,
                           max_total_tokens=max(16384, 16 * args.length)) as server:
            rows = run(server.url, AutoTokenizer.from_pretrained(model_path))
    out = Path(args.out)
    write(rows, out)
    print(table(rows))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'accuracy_vs_keep_fraction.png'}")
    return 0
