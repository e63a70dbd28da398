"""Fine-tune the demo hybrid on the evaluation suite's own formats (RULER templates).

    OMP_NUM_THREADS=1 python -m sglang_kvx.training.finetune_ruler --init weights/tiny-hybrid \\
        --out weights/tiny-hybrid-ruler --minutes 9

``train_demo`` teaches retrieval in its own needle wording; the suite asks in RULER's
(7-digit values, hyphenated keys, its question templates). This continues from a trained
checkpoint on samples from ``sglang_kvx.eval`` at training-only seeds (the suite evaluates
seeds below 1000; these start at 10**6), mixed with the original needle data so the
retrieval skill is kept. Loss, batching and saving are train_demo's.
"""

from __future__ import annotations

import argparse
import sys
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_kvx.eval import generate_sample
from sglang_kvx.training.train_demo import (
    NeedleDataGenerator,
    Sample,
    TrainConfig,
    collate,
    compute_loss,
    make_optimizer,
    save_checkpoint,
)

TRAIN_SEED_BASE = 10**6
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "qa_1")


def grow_depth(model, times: int, seed: int):
    """A model ``times`` as deep: the trained blocks first, then fresh copies of the same
    layer pattern whose output projections start at zero, so the grown model computes
    exactly what the trained one did and training only adds to it. The fresh GDN layers
    get the long-memory decay spread (heads with half-lives from a few to hundreds of tokens)."""
    from transformers import AutoModelForCausalLM

    from sglang_kvx.models.demo import _long_memory_decay_

    config = model.config.__class__.from_dict(model.config.to_dict())
    layer_types = list(config.layer_types)
    config.layer_types = layer_types * times
    config.num_hidden_layers = len(config.layer_types)
    torch.manual_seed(seed)
    grown = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _long_memory_decay_(grown, seed + 7)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    if unexpected:
        raise RuntimeError(f"grow_depth: unexpected weights {unexpected[:4]}")
    with torch.no_grad():
        for layer in grown.model.layers[len(layer_types):]:
            out_proj = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            out_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def ruler_sample(tokenizer, task: str, length: int, rng: random.Random) -> Sample:
    sample = generate_sample(task, length, seed=TRAIN_SEED_BASE + rng.randrange(10**6), index=rng.randrange(1000), tokenizer=tokenizer)
    prompt = tokenizer(sample.prompt).input_ids
    answer = tokenizer(" " + ", ".join(sample.answers)).input_ids
    return Sample(prompt + answer, len(prompt), task, tuple(sample.answers))


def learning_rate(peak: float, schedule: str, step: int, warmup_steps: int, progress: float) -> float:
    """Linear warm-up, then ``constant`` or ``cosine`` (down to a tenth of the peak at the end of
    the time budget; ``progress`` is the share of it used)."""
    warm = min(1.0, (step + 1) / warmup_steps)
    if schedule == "constant":
        return peak * warm
    if schedule == "cosine":
        return peak * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
    raise ValueError(f"unknown learning-rate schedule {schedule!r} (constant, cosine)")


def finetune(model, tokenizer, minutes: float, seed: int, lengths=(512, 768, 1024), ruler_share: float = 0.6,
             tasks: tuple[str, ...] = RULER_TASKS, lr: float = 1e-3, schedule: str = "constant") -> dict:
    cfg = replace(TrainConfig(seed=seed), lr=lr, warmup_steps=20)
    learning_rate(lr, schedule, 0, cfg.warmup_steps, 0.0)  # an unknown schedule fails before training
    torch.manual_seed(seed)
    rng = random.Random(seed)
    needles = NeedleDataGenerator(tokenizer, seed)
    optimizer = make_optimizer(model, cfg)
    pad_id = tokenizer.pad_token_id
    start, steps, tokens, ema = time.monotonic(), 0, 0, None
    bar = tqdm(total=round(minutes * 60), unit="s", dynamic_ncols=True)
    model.train()
    while time.monotonic() - start < minutes * 60:
        length = rng.choice(lengths)
        n_seq = max(1, cfg.tokens_per_batch // length)
        samples = [
            ruler_sample(tokenizer, rng.choice(tasks), length, rng) if rng.random() < ruler_share
            else needles.sample(rng.choice(("single", "multikey", "multivalue")), length, rng)
            for _ in range(n_seq)
        ]
        batch = collate(samples, pad_id)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg.lr, schedule, steps, cfg.warmup_steps, (time.monotonic() - start) / (minutes * 60))
        loss, _, answer_loss = compute_loss(model, batch, cfg.lm_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        steps += 1
        tokens += int(batch.input_ids.numel())
        ema = answer_loss if ema is None else 0.95 * ema + 0.05 * answer_loss
        bar.n = round(time.monotonic() - start)
        bar.set_postfix(step=steps, answer_loss=f"{ema:.3f}")
        bar.refresh()
    bar.close()
    model.eval()
    return {"steps": steps, "tokens": tokens, "minutes": round((time.monotonic() - start) / 60, 2), "final_answer_loss": ema}


def half_life_report(model, tokenizer, length: int = 1024, seed: int = 0) -> dict:
    """Per GDN value head, its half-life (ln 0.5 / mean log-decay) on two unrelated suite documents,
    and how stable the ordering of heads is across them (Spearman over all heads; the GateSight
    paper reports 0.99 on its models)."""
    from sglang_kvx.training.train_demo import measure_gdn_half_lives, summarize_half_lives

    docs = [generate_sample(task, length, seed=TRAIN_SEED_BASE + seed, index=i, tokenizer=tokenizer)
            for i, task in enumerate(("niah_single_2", "vt"))]
    runs = [measure_gdn_half_lives(model, tokenizer(d.prompt).input_ids) for d in docs]
    flat = [torch.tensor([h for layer in run.values() for h in layer]) for run in runs]
    from sglang_kvx.training.train_gatesight import spearman

    return {
        "definition": f"ln(0.5) / mean_t g_t per value head over a {length}-token document",
        "per_head": runs[0],
        "per_layer": summarize_half_lives(runs[0]),
        "spearman_across_documents": round(spearman(flat[0], flat[1]), 4),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_kvx.training.finetune_ruler", description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="weights/tiny-hybrid",
                        help="trained checkpoint folder to start from (default: %(default)s)")
    parser.add_argument("--out", default="weights/tiny-hybrid-ruler",
                        help="checkpoint folder to write; may equal --init to continue in place (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="wall-clock budget of the training loop in minutes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampled training data and of the blocks --grow adds; suite samples use "
                             "seeds from 10**6 up, apart from the evaluated ones (default: %(default)s)")
    parser.add_argument("--grow", type=int, default=1,
                        help="stack the layer pattern this many times first; new blocks start as identity "
                             "(default: %(default)s, no growth)")
    parser.add_argument("--tasks", default=",".join(RULER_TASKS),
                        help="comma-separated suite tasks to train on (default: %(default)s)")
    parser.add_argument("--lengths", default="512,768,1024",
                        help="comma-separated sample lengths in tokens, one drawn per batch; repeat one to weight it "
                             "(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="peak learning rate of AdamW, reached after 20 warm-up steps (default: %(default)s)")
    parser.add_argument("--schedule", default="constant", choices=("constant", "cosine"),
                        help="learning rate after the warm-up: constant, or cosine down to a tenth of the peak at "
                             "the end of --minutes (default: %(default)s)")
    parser.add_argument("--ruler-share", type=float, default=0.6,
                        help="share in [0, 1] of suite samples in a batch; the rest is train_demo's needle data "
                             "(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.ruler_share <= 1.0:
        parser.error("--ruler-share must lie in [0, 1]")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # the GDN chunked rule hits a denormal slow path with more
    tokenizer = AutoTokenizer.from_pretrained(args.init)
    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    meta_file = Path(args.init) / "kvx_demo.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {"name": "tiny-hybrid"}
    if args.grow > 1:
        model = grow_depth(model, args.grow, args.seed)
        meta["name"] = Path(args.out).name
    result = finetune(model, tokenizer, args.minutes, args.seed, lengths=lengths, tasks=tasks,
                      ruler_share=args.ruler_share, lr=args.lr, schedule=args.schedule)
    if "ruler_finetune" in meta:  # a checkpoint fine-tuned again keeps the whole chain
        meta.setdefault("earlier_finetunes", []).append(meta["ruler_finetune"])
    meta["ruler_finetune"] = {**result, "tasks": list(tasks), "lengths": list(lengths), "grow": args.grow, "seed": args.seed,
                              "lr": args.lr, "schedule": args.schedule, "ruler_share": args.ruler_share,
                              "command": "python -m sglang_kvx.training.finetune_ruler " + " ".join(argv if argv is not None else sys.argv[1:])}
    if getattr(model.config, "layer_types", None) and "linear_attention" in model.config.layer_types:
        with torch.no_grad():
            meta["gdn_half_lives"] = half_life_report(model.eval(), tokenizer)
    save_checkpoint(model, tokenizer, args.out, meta)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
