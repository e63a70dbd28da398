"""Needle retention: which share of the needles' KV entries each policy keeps, offline.

    OMP_NUM_THREADS=1 python -m sglang_kvx.eval.retention --tasks niah_single_3,niah_multikey_1 \\
        --length 2048 --samples 8 --policies keydiff,gatesight,gatesight@flat --fractions 0.2,0.1

Accuracy on the suite is a coarse, noisy signal on a small model (one digit lost fails a
sample). Retention is its cause, measured directly: every generated sample knows the token span
of each needle it asks about, so after one HF prefill of the context (the offline producer of the
same signals the server captures) each policy's keep-set is chosen by the same
score -> allocate -> select code the server runs, and we count how many entries of the needles'
values (the tokens an answer copies) survive per attention layer and KV head. Reported per policy
and fraction: the mean share of value entries kept, and the share of (value, layer, head) triples
that keep the whole value.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sglang_kvx.eval.tasks import TASKS, generate_sample
from sglang_kvx.select.keep_set import KeepSet, choose_keep_set


def needle_spans(sample, tokenizer) -> list[tuple[int, int]]:
    """Token spans [start, end) of the queried needles' values inside the tokenized context
    (the tokens an answer must copy; the needle's template words are left out).

    Char offsets come from the generator and token offsets from the tokenizer; a value whose
    tokens do not decode back to it fails loudly instead of measuring the wrong tokens."""
    encoded = tokenizer(sample.context, return_offsets_mapping=True)
    ids, offsets = encoded.input_ids, encoded.offset_mapping
    spans = []
    for needle in sample.metadata.get("needles", []):
        if not needle.get("queried", True):
            continue
        value = str(needle["value"])
        first = needle["char_span"][0] + needle["text"].index(value)
        last = first + len(value)
        tokens = [i for i, (a, b) in enumerate(offsets) if a < last and b > first]
        text = tokenizer.decode(ids[tokens[0] : tokens[-1] + 1]) if tokens else ""
        if value not in text:
            raise ValueError(f"needle value {value!r} maps to tokens decoding to {text!r}")
        spans.append((tokens[0], tokens[-1] + 1))
    return spans


def retention(keep: KeepSet, spans: list[tuple[int, int]]) -> tuple[float, float, list[float]]:
    """(mean share of the values' entries kept, share of (value, layer, head) keeping the whole
    value, and the first figure per attention layer)."""
    if not spans:
        raise ValueError("no queried needle in these samples: retention needs needle tasks")
    per_layer, whole = [], []
    for layer in range(keep.num_layers):
        mask = keep.mask(layer)  # [kv_heads, n]
        kept = torch.stack([mask[:, start:end].float().mean(dim=1) for start, end in spans])  # [values, heads]
        per_layer.append(float(kept.mean()))
        whole.extend((kept == 1.0).float().flatten().tolist())
    return sum(per_layer) / len(per_layer), sum(whole) / len(whole), per_layer


def _policy(method: str, model_path: str, estimator: str | None):
    """The policy object a server with these settings would apply (the server's own factory)."""
    from sglang_kvx.config import KvxConfig, make_policy

    return make_policy(method.partition("@")[0], KvxConfig(estimator=estimator or "", model_path=model_path))


def measure(
    model_path: str,
    tasks: list[str],
    length: int,
    samples: int,
    methods: list[str],
    fractions: list[float],
    seed: int = 0,
    estimator: str | None = None,
) -> list[dict[str, Any]]:
    from sglang_kvx.reference.hf import HFReference
    from sglang_kvx.reference.signals import context_signals

    ref = HFReference(model_path)
    policies = {m: _policy(m, model_path, estimator) for m in methods}
    sums: dict[tuple[str, str, float], list[tuple[float, float]]] = defaultdict(list)
    with torch.no_grad():
        for task in tasks:
            for index in tqdm(range(samples), desc=f"retention {task}", dynamic_ncols=True):
                sample = generate_sample(task, length, seed=seed, index=index, tokenizer=ref.tokenizer)
                spans = needle_spans(sample, ref.tokenizer)
                if not spans:
                    continue
                ids = ref.tokenizer(sample.context).input_ids
                signals = context_signals(ref, ids)
                if any(m.partition("@")[0] == "kvzip" for m in methods):
                    from sglang_kvx.reference.kvzip import reconstruction_attention

                    signals.reconstruction_attention = reconstruction_attention(ref, ids)
                for method, policy in policies.items():
                    allocation = method.partition("@")[2] or None
                    for p in fractions:
                        keep = choose_keep_set(policy, signals, p, allocation)
                        sums[(method, task, p)].append(retention(keep, spans))
    rows = []
    for (method, task, p), values in sums.items():
        rows.append({
            "policy": method, "task": task, "keep_fraction": p, "samples": len(values),
            "value_entries_kept": round(sum(v[0] for v in values) / len(values), 4),
            "whole_value_kept": round(sum(v[1] for v in values) / len(values), 4),
            "value_entries_kept_per_layer": [round(sum(v[2][l] for v in values) / len(values), 4) for l in range(len(values[0][2]))],
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Mean over tasks, one line per policy: value entries kept (whole values kept) per fraction."""
    fractions = sorted({r["keep_fraction"] for r in rows}, reverse=True)
    by_policy: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_policy[r["policy"]][r["keep_fraction"]].append(r)
    lines = ["| policy | " + " | ".join(f"p={p:g}" for p in fractions) + " |", "|---" * (len(fractions) + 1) + "|"]
    for policy, cells in by_policy.items():
        parts = []
        for p in fractions:
            cell = cells.get(p, [])
            if not cell:
                parts.append("-")
                continue
            kept = 100 * sum(r["value_entries_kept"] for r in cell) / len(cell)
            whole = 100 * sum(r["whole_value_kept"] for r in cell) / len(cell)
            parts.append(f"{kept:.1f} ({whole:.1f})")
        lines.append(f"| {policy} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_kvx.eval.retention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: the embedded demo hybrid)")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multiquery,niah_multivalue",
                        help="comma-separated needle tasks of the suite (default: %(default)s)")
    parser.add_argument("--length", type=int, default=2048, help="context length in tokens (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=8, help="contexts per task (default: %(default)s)")
    parser.add_argument("--policies", default="streamingllm,keydiff,snapkv,gatesight,gatesight@flat,gatesight@pyramidkv",
                        help="comma-separated policies; POLICY@ALLOCATION runs a policy's scores under another "
                             "layer allocation (default: %(default)s)")
    parser.add_argument("--fractions", default="0.5,0.2,0.1", help="comma-separated keep fractions (default: %(default)s)")
    parser.add_argument("--estimator", default=None, help="GateSight estimator folder (default: the one shipped for the model)")
    parser.add_argument("--seed", type=int, default=0, help="suite seed of the generated contexts (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}")
    from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root

    ensure_demo_models()
    model_path = args.model or str(weights_root() / DEFAULT_MODEL)
    torch.set_num_threads(1)
    rows = measure(model_path, tasks, args.length, args.samples, [m for m in args.policies.split(",") if m],
                   [float(f) for f in args.fractions.split(",") if f], args.seed, args.estimator)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print("needle value entries kept, % (whole values kept, %), mean over tasks:")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
