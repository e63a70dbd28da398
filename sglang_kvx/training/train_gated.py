"""Train the learned sigmoid-gate eviction model family (issue 15, item 1), nanoGPT style.

Usage::

    OMP_NUM_THREADS=1 python -m sglang_kvx.training.train_gated [--cells all] [--steps N] [--minutes-per-cell M]

One process trains the chosen cells of the paper's 2 x 2 x 2 design
(softmax|sigmoid x rope|nope x gate|none, model in ``sglang_kvx/models/gated.py``)
one after the other, on the same data, tokenizer, split, initial weights
(for a cell and its gate/none twin) and batch order, and writes each to
``<out>/<cell>/``: config.json, model.safetensors, the tokenizer, and
manifest.json (data sources and their sha256, the document split, the
command, steps done and planned, final train and validation loss, wall time).

Data: real English text shipped with Python and its packages, found offline:

* ``pydoc`` - CPython's ``pydoc_data.topics`` (the Python language reference
  and library topics used by ``help()``), one document per topic;
* ``opticks`` - Newton's *Opticks* (Project Gutenberg text) shipped as test data
  by the ``apache-tvm-ffi`` wheel (``tvm_ffi/3rdparty/libbacktrace``), cut at
  paragraph boundaries into documents of about ``--doc-chars`` characters.

Documents are split train/validation/test by a seeded shuffle; a byte-level BPE
is trained on the train split only. Training samples random 512-token windows
of the train stream; validation loss is cross-entropy over consecutive
non-overlapping windows of the validation stream.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the other core is someone else's
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import hashlib
import json
import math
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_kvx.models.gated import ALL_CELLS, build_model, parse_cell, register

SOURCES = ("pydoc", "opticks")
EOS = "<|endoftext|>"


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cells", default="all",
                   help=f"comma-separated cells to train, or 'all' ({', '.join(ALL_CELLS)})")
    p.add_argument("--out", default="weights/gated", help="output folder; each cell goes to <out>/<cell>/")
    p.add_argument("--sources", default="pydoc,opticks", help=f"comma-separated text sources ({', '.join(SOURCES)})")
    p.add_argument("--doc-chars", type=int, default=8000,
                   help="long texts (opticks) are cut into documents of about this many characters")
    p.add_argument("--split", default="0.8,0.1,0.1", help="train,validation,test fractions of the documents")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the document shuffle that makes the split")
    p.add_argument("--vocab-size", type=int, default=2048, help="byte-level BPE vocabulary, trained on the train split")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head dim = d-model / heads)")
    p.add_argument("--d-ff", type=int, default=512, help="MLP hidden size")
    p.add_argument("--context", type=int, default=512,
                   help="training sequence length in tokens (the eval protocol uses 384 prefill + 128 decode)")
    p.add_argument("--gate-lambda", type=float, default=0.03, help="weight of mean(g) in the loss (paper: 0.03)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=600,
                   help="optimizer steps per cell, the cosine schedule's length (600: ~20 min a cell at ~2 s/step on one core, ~2.7 h for all eight)")
    p.add_argument("--minutes-per-cell", type=float, default=None,
                   help="wall-clock cap per cell in minutes; a cell stopped by it is saved and labelled partial")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decay floor, as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=60, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices and embeddings")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--eval-every", type=int, default=250, help="validation loss every this many steps (0: only at the end)")
    p.add_argument("--eval-windows", type=int, default=32,
                   help="validation windows per evaluation (the final evaluation uses all of them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order (same for every cell)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------
# Data: documents, split, tokenizer
# ---------------------------------------------------------------------------


def _chunk_paragraphs(text: str, doc_chars: int) -> list[str]:
    docs, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= doc_chars:
            docs.append(cur.strip())
            cur = ""
    if cur.strip():
        docs.append(cur.strip())
    return docs


def opticks_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("source 'opticks' needs the apache-tvm-ffi wheel (tvm_ffi) installed; drop it with --sources pydoc")
    path = Path(list(spec.submodule_search_locations)[0]) / "3rdparty" / "libbacktrace" / "Isaac.Newton-Opticks.txt"
    if not path.exists():
        raise FileNotFoundError(f"source 'opticks' not found at {path}; drop it with --sources pydoc")
    return path


def load_documents(sources: list[str], doc_chars: int = 8000) -> tuple[list[dict], dict]:
    """Documents as {"id", "text"} and, per source, where it came from and its sha256."""
    docs: list[dict] = []
    info: dict = {}
    for src in sources:
        if src == "pydoc":
            import pydoc_data.topics as topics

            raw = "".join(topics.topics[k] for k in sorted(topics.topics))
            info[src] = {"what": "CPython pydoc_data.topics (Python reference/library topics)",
                         "python": sys.version.split()[0], "file": topics.__file__,
                         "chars": len(raw), "sha256": hashlib.sha256(raw.encode()).hexdigest()}
            docs += [{"id": f"pydoc:{k}", "text": topics.topics[k].strip()} for k in sorted(topics.topics)]
        elif src == "opticks":
            path = opticks_path()
            raw = path.read_text(encoding="utf-8", errors="replace")
            info[src] = {"what": "Newton, Opticks (Project Gutenberg), shipped by the apache-tvm-ffi wheel",
                         "file": str(path), "chars": len(raw), "sha256": hashlib.sha256(raw.encode()).hexdigest(),
                         "doc_chars": doc_chars}
            docs += [{"id": f"opticks:{i:03d}", "text": t} for i, t in enumerate(_chunk_paragraphs(raw, doc_chars))]
        else:
            raise ValueError(f"unknown source {src!r}; choose from {', '.join(SOURCES)}")
    return docs, info


def split_documents(ids: list[str], fractions: tuple[float, float, float], seed: int) -> dict[str, list[str]]:
    """A fixed, seeded split by document: disjoint, every document in exactly one part."""
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(fractions[1] * len(order)))
    n_test = max(1, round(fractions[2] * len(order)))
    n_train = len(order) - n_val - n_test
    return {"train": sorted(order[:n_train]), "validation": sorted(order[n_train:n_train + n_val]),
            "test": sorted(order[n_train + n_val:])}


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (as the project's tiny tokenizer) on the train split, as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=65536)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Documents joined as one stream, each followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t, add_special_tokens=False) + [eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``length`` tokens (the tail is dropped)."""
    n = len(stream) // length
    return stream[: n * length].view(n, length)


# ---------------------------------------------------------------------------
# Training one cell
# ---------------------------------------------------------------------------


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate(model, val: torch.Tensor, batch_size: int, limit: int | None = None) -> dict:
    """Mean cross-entropy (nats/token) and mean gate over validation windows."""
    model.eval()
    rows = val if limit is None else val[:limit]
    ce_sum, n_tok, g_sum, g_n = 0.0, 0, 0.0, 0
    for i in range(0, len(rows), batch_size):
        x = rows[i:i + batch_size]
        out = model(x, labels=x)
        n = x.numel() - x.shape[0]
        ce_sum += out.ce_loss.item() * n
        n_tok += n
        if out.gate_mean is not None:
            g_sum += out.gate_mean.item() * x.shape[0]
            g_n += x.shape[0]
    model.train()
    return {"val_loss": ce_sum / n_tok, "val_ppl": math.exp(ce_sum / n_tok), "val_gate_mean": (g_sum / g_n) if g_n else None,
            "val_windows": len(rows)}


def train_cell(cell: str, args, tokenizer, train: torch.Tensor, val: torch.Tensor, manifest_base: dict) -> dict:
    model = build_model(
        cell, seed=args.seed, vocab_size=len(tokenizer), hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.d_ff, max_position_embeddings=args.context,
        gate_lambda=args.gate_lambda, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms, gate w/b stay undecayed
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    rng = torch.Generator().manual_seed(args.seed)  # the same batch order for every cell
    initial = evaluate(model, val, args.batch_size, args.eval_windows)
    history, recent = [{"step": 0, **initial, "seconds": 0.0}], []
    t0 = time.time()
    stopped_by = "steps"
    pbar = tqdm(range(args.steps), desc=cell, unit="step", dynamic_ncols=True)
    step = 0
    for step in pbar:
        if args.minutes_per_cell is not None and time.time() - t0 > args.minutes_per_cell * 60:
            stopped_by = "minutes-per-cell"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train) - args.context, (args.batch_size,), generator=rng)
        x = torch.stack([train[s:s + args.context] for s in starts.tolist()])
        out = model(x, labels=x)  # loss = CE + lambda * mean(g)  (8)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        recent = (recent + [out.ce_loss.item()])[-50:]
        gate = out.gate_mean.item() if out.gate_mean is not None else None
        pbar.set_postfix(ce=f"{out.ce_loss.item():.3f}", gate="-" if gate is None else f"{gate:.3f}",
                         lr=f"{lr_at(step, args):.1e}")
        if args.eval_every and (step + 1) % args.eval_every == 0:
            ev = evaluate(model, val, args.batch_size, args.eval_windows)
            history.append({"step": step + 1, "train_ce": sum(recent) / len(recent), **ev,
                            "seconds": round(time.time() - t0, 1)})
            pbar.write(f"{cell} step {step + 1}: train ce {history[-1]['train_ce']:.3f}  val ce {ev['val_loss']:.3f}"
                       + ("" if ev["val_gate_mean"] is None else f"  gate {ev['val_gate_mean']:.3f}"))
    else:
        step = args.steps
    pbar.close()
    steps_done = step
    train_seconds = time.time() - t0
    final = evaluate(model, val, args.batch_size)  # every validation window
    out_dir = Path(args.out) / cell
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    manifest = {
        **manifest_base,
        "cell": cell,
        "attention": model.config.attention, "position": model.config.position, "gate": model.config.gate,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps_planned": args.steps,
        "steps_done": steps_done,
        "partial": steps_done < args.steps,
        "stopped_by": stopped_by,
        "tokens_seen": steps_done * args.batch_size * args.context,
        "initial_val_loss": initial["val_loss"],
        "final_train_ce": (sum(recent) / len(recent)) if recent else None,
        **{f"final_{k}": v for k, v in final.items()},
        "train_seconds": round(train_seconds, 1),
        "history": history,
        "tau": None,  # frozen later by the paper's validation sweep (issue 15, item 4)
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_summary(out: str | Path) -> Path:
    """``<out>/summary.json``: one row per trained cell, read back from the manifests."""
    out = Path(out)
    keys = ("cell", "steps_done", "steps_planned", "partial", "stopped_by", "tokens_seen", "initial_val_loss",
            "final_train_ce", "final_val_loss", "final_val_ppl", "final_val_gate_mean", "train_seconds")
    rows = [{k: json.loads(p.read_text()).get(k) for k in keys} for p in sorted(out.glob("*/manifest.json"))]
    path = out / "summary.json"
    path.write_text(json.dumps(rows, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------
# Main: data once, then every cell
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    register()
    cells = list(ALL_CELLS) if args.cells == "all" else [c.strip() for c in args.cells.split(",") if c.strip()]
    for c in cells:
        parse_cell(c)
    fractions = tuple(float(f) for f in args.split.split(","))
    if len(fractions) != 3 or abs(sum(fractions) - 1) > 1e-6:
        raise SystemExit("--split needs three fractions summing to 1, e.g. 0.8,0.1,0.1")

    docs, source_info = load_documents([s.strip() for s in args.sources.split(",")], args.doc_chars)
    split = split_documents([d["id"] for d in docs], fractions, args.split_seed)
    by_id = {d["id"]: d["text"] for d in docs}
    tokenizer = train_tokenizer([by_id[i] for i in split["train"]], args.vocab_size)
    train = token_stream(tokenizer, [by_id[i] for i in split["train"]])
    val = windows(token_stream(tokenizer, [by_id[i] for i in split["validation"]]), args.context)
    test_tokens = len(token_stream(tokenizer, [by_id[i] for i in split["test"]]))
    print(f"{len(docs)} documents: train {len(split['train'])} ({len(train)} tokens), "
          f"validation {len(split['validation'])} ({val.numel()} tokens in {len(val)} windows), "
          f"test {len(split['test'])} ({test_tokens} tokens)")

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
    manifest_base = {
        "command": "python -m sglang_kvx.training.train_gated " + shlex.join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "git_commit": commit,
        "torch": torch.__version__,
        "sources": source_info,
        "split": {"seed": args.split_seed, "fractions": list(fractions), "unit": "document", **split,
                  "tokens": {"train": len(train), "validation": val.numel(), "test": test_tokens}},
    }
    results = []
    for cell in cells:
        m = train_cell(cell, args, tokenizer, train, val, manifest_base)
        results.append(m)
        print(f"{cell}: {m['steps_done']}/{m['steps_planned']} steps, val ce {m['final_val_loss']:.4f} "
              f"(ppl {m['final_val_ppl']:.2f}), {m['train_seconds'] / 60:.1f} min"
              + ("" if m["final_val_gate_mean"] is None else f", gate mean {m['final_val_gate_mean']:.3f}"))
    write_summary(args.out)
    return results


if __name__ == "__main__":
    main()
