"""Train KVzap's surrogates for one dense checkpoint (issue #57), and report their held-out fit per layer.

    OMP_NUM_THREADS=1 python -m sglang_kvx.training.train_kvzap --model weights/smollm2-135m-instruct
    OMP_NUM_THREADS=1 python -m sglang_kvx.training.train_kvzap --model weights/tiny-llama

1. Texts: contexts of the evaluation suite's generators (``sglang_kvx.eval.tasks``, every task type in
   turn) at training-only seeds (from 5 * 10**6; the suite evaluates seeds below 1000), about
   ``--length`` tokens each; the last ``--heldout`` texts are held out whole (the fit is judged on
   texts it never saw, not on other tokens of the same texts).
2. Per text, one HF prefill and KVzip's reconstruction pass with KVzip+'s normalisation
   (``reference.kvzap.kvzip_plus_targets``): every token's input hidden state at each attention layer
   and the log KVzip+ score of its entry per KV head (the paper's targets, Eq. 3 in log space).
   ``--tokens-per-text`` random tokens of each training text are kept (the paper keeps 500 of each
   prompt); held-out texts keep all of theirs.
3. Per attention layer: the linear surrogate by ridge regression in closed form (alpha 1, intercept
   unpenalised: scikit-learn's ``Ridge()``, which the paper's code fits), and the MLP surrogate
   Linear(D, D/8) -> GELU -> Linear(D/8, H_kv) with MSE, AdamW (lr 5e-3, the kvpress trainer's),
   batch 512, a cosine schedule and gradient clipping at 1, every layer's MLP trained at once. The
   MLP learns standardised targets from standardised inputs; both standardisations are folded into
   its layers afterwards, so the saved module reads raw hidden states and gives log scores, as
   kvpress's ``KVzapModel`` does.
4. Held-out R^2 per layer (mean over its KV heads, 1 - SSE / SST per head) for both, printed and
   written to each manifest with the fingerprint of the checkpoint, the command, and the threshold:
   the tau at which the surrogate's held-out predictions keep half of the entries outside the
   128-token window (rounded to 0.1), beside the kept fraction at each tau of a grid.
   Saved to ``weights/kvzap/<model folder>/{linear,mlp}``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_kvx.gatesight.estimator import config_hash, model_fingerprint
from sglang_kvx.policies.kvzap import WINDOW, KVzapSurrogate

TRAIN_SEED_BASE = 5 * 10**6
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
RIDGE_ALPHA = 1.0
LEARNING_RATE = 5e-3
BATCH = 512
KEEP_TARGET = 0.5  # the manifest's threshold keeps this share of the held-out entries outside the window


def texts(tokenizer, count: int, length: int, tasks: tuple[str, ...]) -> list[tuple[str, list[int]]]:
    """(task, token ids) of ``count`` contexts at training-only seeds, the tasks in turn."""
    from sglang_kvx.eval.tasks import generate_sample

    out = []
    for i in range(count):
        task = tasks[i % len(tasks)]
        sample = generate_sample(task, length, seed=TRAIN_SEED_BASE + i, index=0, tokenizer=tokenizer)
        out.append((task, tokenizer(sample.context).input_ids))
    return out


def collect(model: str, docs: list[tuple[str, list[int]]], tokens_per_text: int | None, seed: int):
    """Per text: X [L, t, D] hidden states and Y [L, t, H] log KVzip+ of ``tokens_per_text`` random
    tokens (all with None), from the HF reference."""
    from sglang_kvx.reference.hf import HFReference
    from sglang_kvx.reference.kvzap import kvzip_plus_targets

    ref = HFReference(model)
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for _, ids in tqdm(docs, desc="KVzip+ targets", unit="text", file=sys.stderr):
        targets, hidden = kvzip_plus_targets(ref, ids, with_inputs=True)
        n = len(ids)
        pick = torch.arange(n) if tokens_per_text is None or tokens_per_text >= n else \
            torch.randperm(n, generator=gen)[:tokens_per_text].sort().values
        xs.append(torch.stack([h[pick] for h in hidden]))  # [L, t, D]
        ys.append(torch.stack([y[:, pick].T for y in targets]))  # [L, t, H]
    return torch.cat(xs, dim=1), torch.cat(ys, dim=1)


def fit_ridge(x: torch.Tensor, y: torch.Tensor, alpha: float = RIDGE_ALPHA) -> list[dict[str, torch.Tensor]]:
    """Per layer: argmin ||Y - X W - b||^2 + alpha ||W||^2 (centred, b unpenalised), in float64."""
    layers = []
    for xl, yl in zip(x.double(), y.double()):
        mx, my = xl.mean(0), yl.mean(0)
        xc, yc = xl - mx, yl - my
        w = torch.linalg.solve(xc.T @ xc + alpha * torch.eye(xl.shape[1], dtype=xl.dtype), xc.T @ yc)  # [D, H]
        layers.append({"weight": w.T.float().contiguous(), "bias": (my - mx @ w).float()})
    return layers


def fit_mlp(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Every layer's Linear(D, D/8) -> GELU -> Linear(D/8, H) at once (batched), MSE, AdamW + cosine."""
    torch.manual_seed(seed)
    num_layers, count, d = x.shape
    heads, width = y.shape[2], max(1, d // 8)
    # Inputs and targets standardised per layer (and head): with our few thousand steps (the paper's
    # run takes ~35K) Adam could not move an output bias to a mean log score near -6 from 0.
    mean, std = x.mean(1, keepdim=True), x.std(1, keepdim=True).clamp_min(1e-6)
    y_mean, y_std = y.mean(1, keepdim=True), y.std(1, keepdim=True).clamp_min(1e-6)
    y = (y - y_mean) / y_std

    def uniform(*shape, fan_in):  # nn.Linear's default initialisation
        return ((torch.rand(*shape) * 2 - 1) / math.sqrt(fan_in)).requires_grad_()

    params = [uniform(num_layers, d, width, fan_in=d), uniform(num_layers, 1, width, fan_in=d),
              uniform(num_layers, width, heads, fan_in=width), uniform(num_layers, 1, heads, fan_in=width)]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
    steps = epochs * math.ceil(count / BATCH)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in tqdm(range(epochs), desc="MLP epochs", file=sys.stderr):
        order = torch.randperm(count)
        for start in range(0, count, BATCH):
            index = order[start : start + BATCH]
            xb = (x[:, index] - mean) / std
            out = torch.baddbmm(params[3], F.gelu(torch.baddbmm(params[1], xb, params[0])), params[2])
            loss = F.mse_loss(out, y[:, index])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
    w1, b1, w2, b2 = (p.detach() for p in params)
    w1_raw = w1 / std.transpose(1, 2)  # fold the standardisations in: the module reads raw states, gives log scores
    b1_raw = b1 - mean @ w1_raw
    w2_raw, b2_raw = w2 * y_std, b2 * y_std + y_mean
    return [{"w1": w1_raw[l].T.contiguous(), "b1": b1_raw[l, 0], "w2": w2_raw[l].T.contiguous(), "b2": b2_raw[l, 0]}
            for l in range(num_layers)]


def r2_per_layer(surrogate: KVzapSurrogate, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Held-out R^2 of each layer: the mean over its KV heads of 1 - SSE / SST."""
    out = []
    for layer in range(x.shape[0]):
        pred = surrogate.score(layer, x[layer]).T  # [t, H]
        sse = ((pred - y[layer]) ** 2).sum(0)
        sst = ((y[layer] - y[layer].mean(0)) ** 2).sum(0)
        out.append(float((1 - sse / sst).mean()))
    return out


def kept_fractions(surrogate: KVzapSurrogate, heldout: list[torch.Tensor], taus: list[float]) -> list[float]:
    """Per tau, the share of held-out entries outside each text's last WINDOW tokens scored >= tau."""
    counts, total = [0] * len(taus), 0
    for x in heldout:  # [L, n, D]
        scores = torch.stack([surrogate.score(layer, x[layer]) for layer in range(x.shape[0])])[..., : -WINDOW or None]
        total += scores.numel()
        counts = [c + int((scores >= tau).sum()) for c, tau in zip(counts, taus)]
    return [c / max(total, 1) for c in counts]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_kvx.training.train_kvzap", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weights/tiny-llama", help="checkpoint folder (default: %(default)s)")
    parser.add_argument("--out", default=None, help="default: weights/kvzap/<model folder name>")
    parser.add_argument("--texts", type=int, default=36, help="training texts (default: %(default)s)")
    parser.add_argument("--heldout", type=int, default=6, help="held-out texts (default: %(default)s)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per text, about (default: %(default)s)")
    parser.add_argument("--tokens-per-text", type=int, default=500, help="training tokens kept per text (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=15, help="MLP epochs (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-cache", default=None, help="keep the collected targets in this .pt file and reuse them")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    model = Path(args.model)
    out = Path(args.out) if args.out else Path(__file__).resolve().parents[2] / "weights" / "kvzap" / model.name
    t0 = time.perf_counter()
    cache = Path(args.data_cache) if args.data_cache else None
    job = {"model": model_fingerprint(model), "texts": args.texts, "heldout": args.heldout, "length": args.length,
           "tokens": args.tokens_per_text, "seed": args.seed, "tasks": TASKS}
    if cache is not None and cache.exists() and (saved := torch.load(cache))["job"] == job:
        train_x, train_y, held = saved["train_x"], saved["train_y"], saved["held"]
    else:
        from transformers import AutoTokenizer

        docs = texts(AutoTokenizer.from_pretrained(str(model)), args.texts + args.heldout, args.length, TASKS)
        train_x, train_y = collect(str(model), docs[: args.texts], args.tokens_per_text, args.seed)
        held = [collect(str(model), [doc], None, args.seed) for doc in docs[args.texts :]]
        if cache is not None:
            torch.save({"job": job, "train_x": train_x, "train_y": train_y, "held": held}, cache)
    t_data = time.perf_counter() - t0
    held_x, held_y = torch.cat([h[0] for h in held], 1), torch.cat([h[1] for h in held], 1)
    fitted = {"linear": fit_ridge(train_x, train_y), "mlp": fit_mlp(train_x, train_y, args.epochs, args.seed)}
    t_fit = time.perf_counter() - t0 - t_data
    command = "OMP_NUM_THREADS=1 python -m sglang_kvx.training.train_kvzap " + shlex.join(sys.argv[1:] if argv is None else argv)
    taus = [round(-12 + 0.5 * i, 1) for i in range(25)]
    report = {}
    for kind, layers in fitted.items():
        surrogate = KVzapSurrogate(kind, layers)
        r2 = r2_per_layer(surrogate, held_x, held_y)
        fine = [round(-12 + 0.1 * i, 1) for i in range(121)]
        kept = kept_fractions(surrogate, [h[0] for h in held], fine)
        threshold = fine[min(range(len(fine)), key=lambda i: abs(kept[i] - KEEP_TARGET))]
        surrogate.manifest = {
            "model_name": model.name, "model_fingerprint": model_fingerprint(model), "config_hash": config_hash(model),
            "threshold": threshold, "window": WINDOW, "target": "log KVzip+ (policies/kvzip.py), per attention layer and KV head",
            "heldout_r2_per_layer": [round(v, 4) for v in r2], "heldout_r2_mean": round(sum(r2) / len(r2), 4),
            "kept_outside_window_at": {str(t): round(k, 4) for t, k in zip(taus, kept_fractions(surrogate, [h[0] for h in held], taus))},
            "data": {"tasks": list(TASKS), "seeds": [TRAIN_SEED_BASE, TRAIN_SEED_BASE + args.texts + args.heldout - 1],
                     "length": args.length, "train_texts": args.texts, "heldout_texts": args.heldout,
                     "train_tokens": int(train_x.shape[1]), "heldout_tokens": int(held_x.shape[1])},
            "training": {"ridge_alpha": RIDGE_ALPHA} if kind == "linear" else {
                "epochs": args.epochs, "lr": LEARNING_RATE, "batch": BATCH, "optimizer": "AdamW, cosine, clip 1.0",
                "hidden_dim": int(layers[0]["w1"].shape[0])},
            "command": command, "seconds": {"targets": round(t_data, 1), "fit": round(t_fit, 1)},
        }
        surrogate.save(out / kind)
        report[kind] = r2
    print(f"{'layer':>5} {'linear R2':>10} {'MLP R2':>8}")
    for layer, (a, b) in enumerate(zip(report["linear"], report["mlp"])):
        print(f"{layer:>5} {a:>10.3f} {b:>8.3f}")
    print(f"{'mean':>5} {sum(report['linear']) / len(r2):>10.3f} {sum(report['mlp']) / len(r2):>8.3f}")
    print(f"saved to {out}/linear and {out}/mlp ({t_data:.0f} s targets, {t_fit:.0f} s fitting)")
    return {"r2": report, "out": str(out)}


if __name__ == "__main__":
    main()
