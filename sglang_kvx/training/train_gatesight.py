"""Train GateSight's utility estimators for one hybrid model, and report how well they rank.

    OMP_NUM_THREADS=1 python -m sglang_kvx.training.train_gatesight --model weights/tiny-hybrid-deep \\
        [--docs-cache runs/gatesight_docs.pt]   # about 30 minutes on one core, most of it labelling

A real hybrid checkpoint (Qwen3.5 / Qwen3-Next family) on a GPU, the model in its bf16 weights:

    python -m sglang_kvx.training.train_gatesight --model /path/to/checkpoint --device cuda \\
        --dtype bfloat16 [--batch-size 4] [--docs-cache runs/<name>_docs.pt]

``--dtype`` is only the model's forward: the captured signals, queries, keys, values and o_proj
weight are cast to float32 before features and leave-one-out labels are computed, and documents
are kept on the CPU. ``--batch-size`` labels that many (context + continuation) sequences per
forward, right-padded (exact: every layer is causal or per-token); the MLPs train on ``--device``.

1. Documents: evaluation-suite sessions at training-only seeds (the suite evaluates seeds below
   1000; these start at 10**6), each a context and several questions with their answers.
2. One HF forward per (context + question + answer) gives the context's GDN signals and output
   gates (features) and the continuation's queries, keys and values (labels: the closed-form
   leave-one-out change of the attention output, ``gatesight.labels``).
3. Per (attention layer, KV head): a 64-unit MLP (the estimator), trained with a listwise loss
   (only the ranking within a document decides a top-K; see ``train_mlp``), and for comparison
   ridge regression, the best single signal (chosen on the training documents) and an age-only MLP.
4. Held-out documents: overlap@10% (share of the true top-10% entries a predictor's top-10%
   recovers) and utility-mass coverage (share of the document's utility its top-10% holds),
   per predictor; the estimator and its manifest (with this report, the checkpoint's fingerprint
   and config hash) go to weights/gatesight/<model>/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_kvx.gatesight.estimator import GateSightEstimator, config_hash, model_fingerprint
from sglang_kvx.gatesight.features import AGE_FEATURES, GDN_WINDOW, all_layer_features
from sglang_kvx.gatesight.labels import leave_one_out_change, utility_labels

TRAIN_SEED_BASE = 10**6
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multivalue", "niah_multiquery", "vt", "qa_1", "qa_2")
HIDDEN_UNITS = 64
TOP_FRACTION = 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACCELERATOR_BATCH = 4  # --batch-size default off the CPU (on the CPU batching is no faster: 1)


@dataclass
class Document:
    task: str
    features: torch.Tensor  # [L, n, F]
    labels: torch.Tensor  # [L, H, n] max-normalised utility
    gate_means: list[float]  # per attention layer: mean output gate over the context


# --- data ------------------------------------------------------------------------


def _context_features(signals, n: int, window: int) -> tuple[torch.Tensor, list[float]]:
    """Features [L, n, F] (float32, CPU) and per-layer mean output gates of the context, read from the
    signals of a (context + continuation) forward. Causal model: the first n tokens' signals are
    exactly the context-only prefill's."""
    signals.n = n
    for gdn in signals.gdn:
        gdn.beta, gdn.g, gdn.v_norm = gdn.beta[:n].float(), gdn.g[:n].float(), gdn.v_norm[:n].float()
    features = all_layer_features(signals, window).float().cpu()
    gate_means = [float(g[:n].float().mean()) for g in signals.output_gate] if signals.output_gate else []
    return features, gate_means


def _continuation_changes(ref, signals, n: int) -> list[torch.Tensor]:
    """Per attention layer, the leave-one-out change [Hkv, T, n] of the continuation's queries, in
    float32 whatever the model's dtype (a bf16 o_proj or cache would round the labels), on the model's device."""
    changes = []
    for layer, layer_id in enumerate(ref.attention_layer_ids):
        attn = ref.model.model.layers[layer_id].self_attn
        changes.append(leave_one_out_change(signals.window_queries[layer].float(), signals.keys[layer].float(),
                                            signals.values[layer].float(), attn.o_proj.weight.detach().float(),
                                            n, attn.scaling))
    return changes


def _document(per_layer_changes: list[list[torch.Tensor]], features: torch.Tensor, gate_means: list[float]) -> Document:
    labels = torch.stack([utility_labels(per_layer) for per_layer in per_layer_changes]).float().cpu()
    return Document(task="", features=features, labels=labels, gate_means=gate_means)


def label_document(ref, context_ids: list[int], continuations: list[list[int]], window: int = GDN_WINDOW) -> Document:
    """Features from the context's prefill and utility labels from every continuation: one forward
    per continuation. The unbatched reference ``label_documents`` must agree with."""
    from sglang_kvx.reference.signals import context_signals

    n = len(context_ids)
    changes: list[list[torch.Tensor]] = [[] for _ in ref.attention_layer_ids]
    features = gate_means = None
    for continuation in continuations:
        signals = context_signals(ref, context_ids + continuation, window=len(continuation), column_sums=False)
        for layer, change in enumerate(_continuation_changes(ref, signals, n)):
            changes[layer].append(change)
        if features is None:
            features, gate_means = _context_features(signals, n, window)
    return _document(changes, features, gate_means)


def label_documents(ref, documents: list[tuple[list[int], list[list[int]]]], batch_size: int = 1,
                    window: int = GDN_WINDOW, progress: tqdm | None = None) -> list[Document]:
    """``label_document`` of every (context ids, continuations), ``batch_size`` (context + continuation)
    sequences per forward, in order (a document's continuations mostly share a batch: similar lengths,
    little padding). Each document is finished (labels reduced, moved to the CPU) as soon as its last
    continuation is labelled, so only a batch's worth of signals is ever on the device."""
    from sglang_kvx.reference.signals import batch_context_signals

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sequences = [(d, c) for d, (_, continuations) in enumerate(documents) for c in range(len(continuations))]
    changes: list[list[list[torch.Tensor]]] = [[[] for _ in ref.attention_layer_ids] for _ in documents]
    features: list[tuple[torch.Tensor, list[float]] | None] = [None] * len(documents)
    done: list[Document | None] = [None] * len(documents)
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        ids = [documents[d][0] + documents[d][1][c] for d, c in batch]
        windows = [len(documents[d][1][c]) for d, c in batch]
        for (d, c), signals in zip(batch, batch_context_signals(ref, ids, windows=windows, column_sums=False, queries=False)):
            n = len(documents[d][0])
            for layer, change in enumerate(_continuation_changes(ref, signals, n)):
                changes[d][layer].append(change)
            if features[d] is None:
                features[d] = _context_features(signals, n, window)
            if c == len(documents[d][1]) - 1:
                done[d] = _document(changes[d], *features[d])
                changes[d] = []  # free the device tensors
                if progress is not None:
                    progress.update()
    return done


def build_documents(ref, count: int, seed: int, tasks: tuple[str, ...], lengths: tuple[int, ...],
                    questions: int, desc: str, batch_size: int = 1) -> list[Document]:
    from sglang_kvx.eval import generate_session

    rng = random.Random(seed)
    tokenizer = ref.tokenizer
    items: list[tuple[list[int], list[list[int]]]] = []
    names = []
    for i in range(count):  # sessions first (cheap): the labelling can then batch across documents
        task, length = tasks[i % len(tasks)], lengths[(i // len(tasks)) % len(lengths)]
        index = rng.randrange(10**6)
        for asked in range(questions, 0, -1):  # a short context may not fit every question
            try:
                session = generate_session(task, length, num_questions=asked, seed=TRAIN_SEED_BASE + seed,
                                           index=index, tokenizer=tokenizer)
                break
            except ValueError:
                if asked == 1:
                    raise
        context_ids = tokenizer(session.context).input_ids
        continuations = [tokenizer(turn.question).input_ids + tokenizer(" " + ", ".join(turn.answers)).input_ids
                         for turn in session.turns]
        items.append((context_ids, continuations))
        names.append(task)
    with tqdm(total=count, desc=desc, dynamic_ncols=True) as bar:
        docs = label_documents(ref, items, batch_size=batch_size, progress=bar)
    for doc, task in zip(docs, names):
        doc.task = task
    return docs


def save_documents(path: str | Path, key: dict, train: list[Document], heldout: list[Document]) -> None:
    as_dicts = lambda docs: [vars(d) for d in docs]  # noqa: E731
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "train": as_dicts(train), "heldout": as_dicts(heldout)}, path)


def load_documents(path: str | Path, key: dict) -> tuple[list[Document], list[Document]] | None:
    """The cached documents, or None (with the reason printed) when there are none for ``key``."""
    if not Path(path).is_file():
        return None
    data = torch.load(path, weights_only=True)
    if data.get("key") != key:
        print(f"train_gatesight: {path} was labelled for other arguments; labelling again", file=sys.stderr)
        return None
    return [Document(**d) for d in data["train"]], [Document(**d) for d in data["heldout"]]


# --- predictors --------------------------------------------------------------------


def _rows(docs: list[Document], layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([d.features[layer] for d in docs]), torch.cat([d.labels[layer, head] for d in docs]))


LOSSES = ("mse", "listwise")


def train_mlp(docs: list[Document], columns: slice | None, epochs: int, seed: int, lr: float = 3e-3,
              batch: int = 4096, desc: str = "estimator", loss: str = "listwise",
              device: str | torch.device = "cpu") -> GateSightEstimator:
    """Every (layer, head) MLP trained together (stacked weights).

    ``mse``: squared error on the max-normalised utility labels, ``batch`` rows shuffled across documents.
    ``listwise`` (the default): one document per step; per layer and head, cross-entropy between the document's utility
    distribution (labels / their sum) and the softmax of the predictions over its entries. Only a
    head's ranking within one document matters for its top-K, and this loss scores exactly that;
    MSE spends most of its effort on the many near-zero labels.

    Runs on ``device``; the initial weights and the shuffles are drawn on the CPU from ``seed``, so
    every device starts from the same estimator. The result is on the CPU."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose from {LOSSES}")
    torch.manual_seed(seed)
    num_layers, num_heads = docs[0].labels.shape[:2]
    x = torch.stack([torch.cat([d.features[l] for d in docs]) for l in range(num_layers)]).to(device)  # [L, N, F]
    y = torch.stack([torch.cat([d.labels[l] for d in docs], dim=1) for l in range(num_layers)]).to(device)  # [L, H, N]
    if columns is not None:
        keep = torch.zeros(x.shape[2], dtype=torch.bool, device=device)
        keep[columns] = True
        x = x * keep  # other inputs read as zero: an estimator restricted to these columns
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(1e-4)
    if columns is not None:
        mean, std = mean * keep, torch.where(keep, std, torch.ones_like(std))
    xs = (x - mean[:, None]) / std[:, None]
    num_features = x.shape[2]
    w1 = (torch.randn(num_layers, num_heads, num_features, HIDDEN_UNITS) / math.sqrt(num_features)).to(device).requires_grad_()
    b1 = torch.zeros(num_layers, num_heads, HIDDEN_UNITS, device=device, requires_grad=True)
    w2 = (torch.randn(num_layers, num_heads, HIDDEN_UNITS) / math.sqrt(HIDDEN_UNITS)).to(device).requires_grad_()
    b2 = torch.zeros(num_layers, num_heads, device=device, requires_grad=True)
    params = [w1, b1, w2, b2]
    optimizer = torch.optim.Adam(params, lr=lr)

    def predict(idx):
        hidden = torch.einsum("lnf,lhfu->lhnu", xs[:, idx], w1) + b1[:, :, None]
        return torch.einsum("lhnu,lhu->lhn", hidden.relu(), w2) + b2[:, :, None]

    total = xs.shape[1]
    if loss == "mse":
        batches = lambda: torch.randperm(total).split(batch)  # noqa: E731
        steps = epochs * math.ceil(total / batch)
    else:
        bounds = torch.tensor([0] + [d.labels.shape[2] for d in docs]).cumsum(0)
        spans = [torch.arange(int(bounds[i]), int(bounds[i + 1])) for i in range(len(docs))]
        batches = lambda: [spans[i] for i in torch.randperm(len(spans)).tolist()]  # noqa: E731
        steps = epochs * len(spans)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    bar = tqdm(total=steps, desc=desc, dynamic_ncols=True)
    for _ in range(epochs):
        for idx in batches():
            idx = idx.to(device)
            pred, target = predict(idx), y[:, :, idx]
            if loss == "mse":
                value = (pred - target).pow(2).mean()
            else:  # one document: its utility distribution against the predictions' softmax
                target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
                value = -(target * pred.log_softmax(dim=-1)).sum(dim=-1).mean()
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            scheduler.step()
            bar.update()
            bar.set_postfix({loss: f"{value.item():.5f}"})
    bar.close()
    return GateSightEstimator(w1=w1.detach().cpu(), b1=b1.detach().cpu(), w2=w2.detach().cpu(), b2=b2.detach().cpu(),
                              feature_mean=mean.cpu(), feature_std=std.cpu())


def fit_ridge(docs: list[Document], alpha: float = 1.0) -> list[list[torch.Tensor]]:
    """Per (layer, head): weights [F + 1] of ridge regression on standardised features (last = bias)."""
    num_layers, num_heads = docs[0].labels.shape[:2]
    models = []
    for layer in range(num_layers):
        per_head = []
        for head in range(num_heads):
            x, y = _rows(docs, layer, head)
            x = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1).double()
            gram = x.T @ x + alpha * torch.eye(x.shape[1], dtype=torch.float64)
            per_head.append(torch.linalg.solve(gram, x.T @ y.double()).float())
        models.append(per_head)
    return models


def heuristic_candidates(features: torch.Tensor, gdn_heads: int) -> torch.Tensor:
    """[n, C] single-signal rankings: every raw feature, its negation, and each head's effective
    write beta * ||v|| (from the beta and log||v|| columns)."""
    gdn = features[:, : features.shape[1] - AGE_FEATURES].reshape(features.shape[0], -1, 3)  # [n, layers*heads, 3]
    effective = gdn[:, :, 0] * gdn[:, :, 2].exp()
    return torch.cat([features, -features, effective, -effective], dim=1)


def choose_heuristic(docs: list[Document], gdn_heads: int) -> list[list[int]]:
    """Per (layer, head): the candidate column with the best mean training overlap@10%."""
    num_layers, num_heads = docs[0].labels.shape[:2]
    best = []
    for layer in range(num_layers):
        per_head = []
        for head in range(num_heads):
            totals = None
            for d in docs:
                cands = heuristic_candidates(d.features[layer], gdn_heads)  # [n, C]
                scores = torch.stack([overlap_at(cands[:, c], d.labels[layer, head]) for c in range(cands.shape[1])])
                totals = scores if totals is None else totals + scores
            per_head.append(int(totals.argmax()))
        best.append(per_head)
    return best


def overlap_at(predicted: torch.Tensor, true: torch.Tensor, fraction: float = TOP_FRACTION) -> torch.Tensor:
    k = max(1, round(fraction * true.numel()))
    pred_top = set(predicted.topk(k).indices.tolist())
    true_top = set(true.topk(k).indices.tolist())
    return torch.tensor(len(pred_top & true_top) / k)


def mass_coverage(predicted: torch.Tensor, true: torch.Tensor, fraction: float = TOP_FRACTION) -> float:
    k = max(1, round(fraction * true.numel()))
    return float(true[predicted.topk(k).indices].sum() / true.sum().clamp_min(1e-30))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().float()
    rb = b.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def evaluate(docs: list[Document], predictors: dict[str, callable]) -> dict[str, dict[str, float]]:
    """Mean over held-out documents, layers and heads of each metric, per predictor."""
    report = {}
    for name, predict in predictors.items():
        sums = {"overlap_at_10": 0.0, "mass_coverage_at_10": 0.0, "spearman": 0.0}
        count = 0
        for d in docs:
            pred = predict(d)  # [L, H, n]
            for layer in range(d.labels.shape[0]):
                for head in range(d.labels.shape[1]):
                    true = d.labels[layer, head]
                    sums["overlap_at_10"] += float(overlap_at(pred[layer, head], true))
                    sums["mass_coverage_at_10"] += mass_coverage(pred[layer, head], true)
                    sums["spearman"] += spearman(pred[layer, head], true)
                    count += 1
        report[name] = {k: round(v / count, 4) for k, v in sums.items()}
    return report


# --- entry point -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_kvx.training.train_gatesight", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="weights/tiny-hybrid-deep",
                        help="hybrid GDN checkpoint folder to train estimators for (default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help="estimator folder to write (default: weights/gatesight/<model folder name>)")
    parser.add_argument("--train-docs", type=int, default=360,
                        help="labelled training documents (default: %(default)s)")
    parser.add_argument("--heldout-docs", type=int, default=30,
                        help="labelled held-out documents the report is measured on (default: %(default)s)")
    parser.add_argument("--lengths", default="1024,2048",
                        help="comma-separated document lengths in tokens, cycled over the documents (default: %(default)s)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help="comma-separated suite tasks the documents come from, cycled (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=3,
                        help="continuations (question + answer) labelled per document (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=60,
                        help="passes over the training documents for each MLP (default: %(default)s)")
    parser.add_argument("--loss", choices=LOSSES, default="listwise",
                        help="the estimator's training loss (train_mlp): mse on the labels, or listwise ranking "
                             "within a document (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the documents (suite seeds from 10**6 up, apart from the evaluated ones) and "
                             "of the MLPs' initialisation (default: %(default)s)")
    parser.add_argument("--docs-cache", default=None,
                        help="file of labelled documents: reused when it was built with the same model and data "
                             "arguments, else (re)built and written; labelling is most of the run (default: none)")
    parser.add_argument("--device", default="cpu",
                        help="torch device the model labels on and the MLPs train on, e.g. cpu, cuda, cuda:1 "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="dtype of the model's weights in the labelling forward; signals and labels are "
                             "float32 whatever it is (default: %(default)s; bfloat16 for a real checkpoint on a GPU)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="(context + continuation) sequences per labelling forward, right-padded; the labels "
                             f"do not depend on it (default: 1 on cpu, where batching is no faster; {ACCELERATOR_BATCH} "
                             "on an accelerator)")
    return parser


def _check_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The torch device ``name``, or a parser error when this machine cannot allocate on it."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        parser.error(f"--device {name!r} is not a torch device ({exc})")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, "
                     f"built with CUDA {torch.version.cuda or 'none'}); use --device cpu")
    try:
        torch.empty(1, device=device)  # an index past the last GPU, an absent MPS / XPU backend, ...
    except (RuntimeError, AssertionError, ValueError) as exc:
        parser.error(f"--device {name} cannot be used here: {exc}")
    return device


def _check_model(parser: argparse.ArgumentParser, model: str) -> None:
    """Refuse, before anything loads, a --model that is not a local hybrid GDN checkpoint with
    gated attention layers (the signals GateSight reads, as the server checks them)."""
    from sglang_kvx.config import KvxConfigError, model_traits

    try:
        traits = model_traits(model)
    except (KvxConfigError, ValueError, OSError) as exc:
        parser.error(f"--model {model}: cannot read its config.json ({exc})")
    if traits is None:
        parser.error(f"--model {model}: no config.json there (a local checkpoint folder is needed)")
    if not (traits.has_gdn and traits.has_output_gate):
        parser.error(f"--model {model}: {traits.architecture} is not a supported hybrid checkpoint: GateSight "
                     f"reads the GDN (linear_attention) layers and gated attention outputs of the Qwen3.5 / "
                     f"Qwen3-Next family ({'it has no GDN layers' if not traits.has_gdn else 'it has no output gates'})")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    from sglang_kvx.reference.hf import HFReference

    device = _check_device(parser, args.device)
    _check_model(parser, args.model)
    batch_size = args.batch_size if args.batch_size is not None else (1 if device.type == "cpu" else ACCELERATOR_BATCH)
    if batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {batch_size}")
    torch.set_num_threads(1)  # the GDN chunked rule hits a denormal slow path with more
    started = time.monotonic()
    ref = HFReference(args.model, dtype=DTYPES[args.dtype])
    try:
        ref.model.to(device)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        parser.error(f"--model {args.model}: transformers cannot load it ({type(exc).__name__}: {exc})")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    data_key = {"model_fingerprint": model_fingerprint(args.model), "train_docs": args.train_docs,
                "heldout_docs": args.heldout_docs, "tasks": list(tasks), "lengths": list(lengths),
                "questions": args.questions, "seed": args.seed}
    if args.dtype != "float32":  # other labels; float32 caches from before --dtype keep their key
        data_key["dtype"] = args.dtype
    cached = load_documents(args.docs_cache, data_key) if args.docs_cache else None
    if cached is not None:
        train_docs, heldout = cached
    else:
        train_docs = build_documents(ref, args.train_docs, args.seed, tasks, lengths, args.questions, "label train docs",
                                     batch_size=batch_size)
        heldout = build_documents(ref, args.heldout_docs, args.seed + 1, tasks, lengths, args.questions,
                                  "label held-out docs", batch_size=batch_size)
        if args.docs_cache:
            save_documents(args.docs_cache, data_key, train_docs, heldout)
    gdn_heads = ref.model.config.linear_num_value_heads
    num_features = train_docs[0].features.shape[2]
    estimator = train_mlp(train_docs, None, args.epochs, args.seed, loss=args.loss, device=device)
    age_only = train_mlp(train_docs, slice(num_features - AGE_FEATURES, num_features), args.epochs, args.seed,
                         desc="age-only", loss=args.loss, device=device)
    ridge = fit_ridge(train_docs)
    heuristic = choose_heuristic(train_docs, gdn_heads)

    def ridge_predict(d: Document) -> torch.Tensor:
        x = torch.cat([d.features, torch.ones(*d.features.shape[:2], 1)], dim=2)
        return torch.stack([torch.stack([x[l] @ ridge[l][h] for h in range(len(ridge[l]))]) for l in range(len(ridge))])

    def heuristic_predict(d: Document) -> torch.Tensor:
        return torch.stack([torch.stack([heuristic_candidates(d.features[l], gdn_heads)[:, c] for c in heuristic[l]])
                            for l in range(len(heuristic))])

    report = evaluate(heldout, {
        "mlp": lambda d: estimator.score(d.features, impl="torch"),
        "ridge": ridge_predict,
        "best_single_signal": heuristic_predict,
        "age_only": lambda d: age_only.score(d.features, impl="torch"),
    })
    model_name = Path(args.model).resolve().name
    out = Path(args.out) if args.out else Path("weights/gatesight") / model_name
    estimator.manifest = {
        "model_name": model_name,
        "model_fingerprint": model_fingerprint(args.model),
        "config_hash": config_hash(args.model),  # lets a refusal tell another config from other weights
        "label_dtype": args.dtype,
        "num_attention_layers": len(ref.attention_layer_ids),
        "num_kv_heads": ref.model.config.num_key_value_heads,
        "gdn_heads": gdn_heads,
        "gdn_window": GDN_WINDOW,
        "hidden_units": HIDDEN_UNITS,
        "loss": args.loss,
        "features": "per preceding GDN layer and value head: beta, g, log||v||; then age/n, log1p(age)/log1p(n), log1p(pos)/log1p(n)",
        "heldout_report": report,
        "heldout_docs": len(heldout),
        "train_docs": len(train_docs),
        "lengths": list(lengths),
        "tasks": list(tasks),
        "mean_output_gate_per_layer": [round(sum(d.gate_means[l] for d in train_docs) / len(train_docs), 4)
                                       for l in range(len(ref.attention_layer_ids))] if train_docs[0].gate_means else [],
        "best_single_signal_columns": heuristic,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "command": "python -m sglang_kvx.training.train_gatesight " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    estimator.save(out)
    print(json.dumps({"out": str(out), "heldout": report}, indent=2))
    return report


if __name__ == "__main__":
    main()
