"""The learned-gate eviction paper's protocol on our model family (Li, arXiv 2608.23296, Sec. 2.5,
3 and 4), in the transformers model with the rules of ``reference/gated.py``.

Sequences are consecutive 512-token windows of a cell's validation or test split (the documents its
manifest names, tokenised by its tokenizer): a ``prefill``-token prefix read at once, then single-
token decode steps over the rest; perplexity is over the decode window (the prefill's last logit
predicts its first token), exp of the mean over sequences of each sequence's mean loss.

* ``sweep``: per gated cell and tau of the paper's grid, the window PPL with learned-gate eviction
  and the compression (1 - live entries / cached entries, over all layers, after the last step);
* ``select_tau``: the highest-compression tau with dPPL < 0.1 against the cell's own tau = 0;
* ``matched``: at tau*, each test sequence's final live-cache size; online H2O and KeyDiff on the
  paired dense backbone with that size per layer (live / layers), window PPL;
* ``random_probe``: dense backbones with random prefill entries deleted: how far each layer's
  attention output moves (mean relative L2 over decode queries), and the PPL;
* ``row_sum_cv`` (CV across query positions of the attention row sums, mean over heads and layers),
  ``binarisation`` (share of gates < 0.05 or > 0.95), ``gate_buckets`` (mean gate per token kind).
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_kvx.models.gated import KeepFn, KvxGatedForCausalLM, register
from sglang_kvx.reference.gated import gate_rule, h2o_rule, keydiff_rule, live_entries, random_rule

TAU_GRID = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the paper's 15 points
DPPL_LIMIT = 0.1
# A small list of English function words (our own, for the token buckets of Sec. 4.3).
STOPWORDS = frozenset("""a an the and or but if then of in on at to for from by with as is are was were be been being
it its this that these those he she they we you i his her their our your my not no so than too very can will would
shall should may might must do does did has have had which who whom what when where why how all any each some such
there here into out up down over under about after before between through during only also just""".split())
BUCKETS = ("content", "stopword", "punctuation", "newline", "whitespace", "digit")

Rules = Callable[[int], "list[KeepFn | None] | None"]  # sequence index -> one rule per layer (None: dense)


def load_cell(path: str | Path) -> KvxGatedForCausalLM:
    register()
    return KvxGatedForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def split_windows(cell_dir: str | Path, split: str, length: int = 512, limit: int | None = None) -> torch.Tensor:
    """[N, length] consecutive windows of a cell's ``split`` documents (validation or test)."""
    from transformers import AutoTokenizer

    from sglang_kvx.training.train_gated import load_documents, token_stream, windows

    manifest = json.loads((Path(cell_dir) / "manifest.json").read_text())
    docs, _ = load_documents(manifest["args"]["sources"].split(","), manifest["args"]["doc_chars"])
    text = {d["id"]: d["text"] for d in docs}
    tokenizer = AutoTokenizer.from_pretrained(str(cell_dir))
    seqs = windows(token_stream(tokenizer, [text[i] for i in manifest["split"][split]]), length)
    return seqs[:limit] if limit else seqs


@torch.no_grad()
def window_losses(model: KvxGatedForCausalLM, seqs: torch.Tensor, prefill: int, rules: Rules | None = None,
                  live_at: float | None = None, desc: str = "") -> tuple[list[float], list[int]]:
    """Each sequence's mean loss over its decode window; with ``live_at`` a tau, also the live
    entries the gates leave after the last step (else the cached count times the layers)."""
    losses, live = [], []
    layers = model.config.num_hidden_layers
    for s, seq in enumerate(tqdm(seqs, desc=desc, leave=False, disable=not desc)):
        ids = seq[None, :-1]
        out = model(ids, keep_fns=rules(s) if rules is not None else None)
        logits = out.logits[0, prefill - 1 :].float()
        losses.append(float(F.cross_entropy(logits, seq[prefill:])))
        cached = ids.shape[1]
        live.append(live_entries(out.gates, live_at, cached) if live_at is not None and out.gates else cached * layers)
    return losses, live


def ppl(losses: list[float]) -> float:
    return math.exp(sum(losses) / len(losses))


def sweep(model: KvxGatedForCausalLM, seqs: torch.Tensor, prefill: int, taus=TAU_GRID, desc: str = "") -> list[dict]:
    points, cached = [], (seqs.shape[1] - 1) * model.config.num_hidden_layers
    for tau in tqdm(taus, desc=desc, leave=False, disable=not desc):
        rules = [gate_rule(tau, prefill)] * model.config.num_hidden_layers
        losses, live = window_losses(model, seqs, prefill, lambda _s: rules, live_at=tau)
        points.append({"tau": tau, "ppl": ppl(losses), "compression": 1 - sum(live) / (len(live) * cached)})
    reference = points[0]["ppl"]
    for point in points:
        point["dppl"] = point["ppl"] - reference
    return points


def select_tau(points: list[dict], limit: float = DPPL_LIMIT) -> dict:
    """The highest-compression grid point with dPPL < limit against tau = 0 (tau = 0 always qualifies)."""
    return max((p for p in points if p["dppl"] < limit), key=lambda p: (p["compression"], -p["tau"]))


def matched(gated: KvxGatedForCausalLM, dense: KvxGatedForCausalLM, seqs: torch.Tensor, prefill: int, tau: float,
            desc: str = "") -> dict:
    """Test at a frozen tau, and H2O / KeyDiff on the dense backbone at each sequence's live-cache size."""
    layers = gated.config.num_hidden_layers
    rules = [gate_rule(tau, prefill)] * layers
    gate_losses, live = window_losses(gated, seqs, prefill, lambda _s: rules, live_at=tau, desc=f"{desc} gate")
    own_losses, _ = window_losses(gated, seqs, prefill)
    dense_losses, _ = window_losses(dense, seqs, prefill, desc=f"{desc} dense")
    budgets = [max(1, round(n / layers)) for n in live]
    kind = dense.config.attention
    h2o_losses, _ = window_losses(dense, seqs, prefill, lambda s: [h2o_rule(budgets[s], prefill, kind)] * layers,
                                  desc=f"{desc} h2o")
    keydiff_losses, _ = window_losses(dense, seqs, prefill, lambda s: [keydiff_rule(budgets[s], prefill)] * layers,
                                      desc=f"{desc} keydiff")
    cached = (seqs.shape[1] - 1) * layers
    return {"tau": tau, "compression": 1 - sum(live) / (len(live) * cached), "gated_ppl": ppl(gate_losses),
            "gated_own_dense_ppl": ppl(own_losses), "dense_backbone_ppl": ppl(dense_losses),
            "h2o_ppl": ppl(h2o_losses), "keydiff_ppl": ppl(keydiff_losses), "budget_per_layer_mean": sum(budgets) / len(budgets)}


@torch.no_grad()
def random_probe(dense: KvxGatedForCausalLM, seqs: torch.Tensor, prefill: int, rates=(0.1, 0.25, 0.5, 0.75),
                 seed: int = 0) -> list[dict]:
    """Random support removal on a dense backbone: relative change of each layer's attention output
    at decode queries (mean over layers, queries and sequences), and the window PPL."""
    outputs: list[torch.Tensor] = []
    hooks = [layer.attn.register_forward_hook(lambda _m, _i, out: outputs.append(out[0][0, prefill - 1 :].float()))
             for layer in dense.model.layers]
    try:
        reference = []
        for seq in seqs:
            outputs.clear()
            dense(seq[None, :-1])
            reference.append(list(outputs))
        result = []
        for rate in rates:
            moved, losses = [], []
            for s, seq in enumerate(seqs):
                outputs.clear()
                rules = [random_rule(rate, prefill, seed + 1000 * s + l) for l in range(len(dense.model.layers))]
                out = dense(seq[None, :-1], keep_fns=rules)
                losses.append(float(F.cross_entropy(out.logits[0, prefill - 1 :].float(), seq[prefill:])))
                for got, want in zip(outputs, reference[s]):
                    moved.append(float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)).mean()))
            result.append({"rate": rate, "attention_output_rel_change": sum(moved) / len(moved), "ppl": ppl(losses)})
    finally:
        for hook in hooks:
            hook.remove()
    return result


@torch.no_grad()
def row_sum_cv(model: KvxGatedForCausalLM, seqs: torch.Tensor) -> float:
    """CV across query positions of each head's attention row sums, mean over heads, layers, sequences."""
    values = []
    for seq in seqs:
        out = model(seq[None], output_attentions=True)
        for a in out.attentions:
            sums = a[0].float().sum(-1)  # [H, T]
            values.append(float((sums.std(-1) / sums.mean(-1).clamp_min(1e-12)).mean()))
    return sum(values) / len(values)


def bucket_of(surface: str) -> str:
    if "\n" in surface:
        return "newline"
    word = surface.strip()
    if not word:
        return "whitespace"
    if word.isdigit():
        return "digit"
    if all(c in string.punctuation for c in word):
        return "punctuation"
    return "stopword" if word.lower() in STOPWORDS else "content"


@torch.no_grad()
def gate_statistics(model: KvxGatedForCausalLM, seqs: torch.Tensor, tokenizer) -> dict:
    """Binarisation (share of gates < 0.05 or > 0.95) and the mean gate per token bucket (Table 4)."""
    totals = {b: [0.0, 0] for b in BUCKETS}
    binary, count = 0, 0
    surface = {}
    for seq in seqs:
        gates = torch.stack(model(seq[None]).gates)[:, 0]  # [L-1, T]
        binary += int(((gates < 0.05) | (gates > 0.95)).sum())
        count += gates.numel()
        for t, token in enumerate(seq.tolist()):
            if token not in surface:
                surface[token] = bucket_of(tokenizer.decode([token]))
            entry = totals[surface[token]]
            entry[0] += float(gates[:, t].sum())
            entry[1] += gates.shape[0]
    return {"binarisation": binary / count,
            "gate_buckets": {b: (s / n if n else None) for b, (s, n) in totals.items()}}
