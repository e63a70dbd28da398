"""Recall-head recipe sweep: train head variants on the cached paired supervision of
``sglang_kvx.training.train_recall_head`` (--reference greedy --reference-tokens 32) and score each
closed loop with the HF oracle (``sglang_kvx.reference.oda.oda_generate``, which the server matches
token for token) on a suite split, at several thetas. One JSON line per (variant, theta).

    OMP_NUM_THREADS=1 python perf/sweep_oda_head.py '{"model": "weights/tiny-hybrid-deep",
        "eval_tasks": "niah_single_1,niah_single_2,niah_single_3,niah_multiquery,niah_multivalue,vt",
        "samples": 8, "eval_seed": 3000001, "out": "/tmp/sweep.jsonl", "length": 2048, "q": 16,
        "train_docs": 780, "dev_docs": 78, "hidden": 128, "new_tokens": 24,
        "variants": [[64, 0.3, 1500, 0], [64, 0.1, 1500, 0]], "thetas": [-0.1, 0.0, 0.1]}'

"window" (default 128, the installed heads' w; sinks stay 4) selects another span.

variants: [width, lambda, steps, seed], optionally followed by policy rounds, AdamW weight decay, a list of update counts whose
checkpoints are averaged (the seed's uniform merge), the number of teacher heads whose mean score the head is trained on
(train_recall_head --teachers) and the training target ("gain", the seed's, or "flip": train_recall_head
--target). Choose recipes on the held-out seed (3000001), never on the test seed 0. Builds the supervision first if /tmp/kvx_oda_supervision lacks it (about 30 min for the above).
The Full and Local arms are cached there too, keyed on the model, the prompts' token ids and the
decoding settings, so a second sweep on the same split only runs the heads.
"""
import hashlib
import json
import sys
import time

import torch

from sglang_kvx.training import train_recall_head as T
from sglang_kvx.reference import oda
from sglang_kvx.reference.hf import HFReference

torch.set_num_threads(1)
CFG = json.loads(sys.argv[1])
MODEL = CFG["model"]
NAME = MODEL.rstrip("/").split("/")[-1]
EVAL_TASKS = CFG["eval_tasks"].split(",")
SAMPLES = CFG["samples"]
EVAL_SEED = CFG.get("eval_seed", T.DEV_SEED)
OUT = CFG["out"]
L, Q, TRAIN, DEV, HID, NEW = CFG["length"], CFG["q"], CFG["train_docs"], CFG["dev_docs"], CFG["hidden"], CFG["new_tokens"]
SINKS, WINDOW = 4, CFG.get("window", 128)  # the installed heads' span by default; the supervision cache is keyed on it
ref = HFReference(MODEL)
for p in ref.model.parameters():
    p.requires_grad_(False)
tasks = list(T.TASKS)
t0 = time.time()
train_docs = T.build_split(ref, NAME, tasks, TRAIN, T.TRAIN_SEED, L, SINKS, WINDOW, Q, "train", "greedy", 32)
dev_docs = T.build_split(ref, NAME, tasks, DEV, T.DEV_SEED, L, SINKS, WINDOW, Q, "dev", "greedy", 32)
print("supervision", time.time() - t0, file=sys.stderr)

prompts = T.suite_prompts(ref, EVAL_TASKS, SAMPLES, L, EVAL_SEED)


def run(route):
    answers = T.generate_arm(ref, prompts, route, NEW, SINKS, WINDOW)
    scores = [a.score for a in answers]
    return 100 * sum(scores) / len(scores), T.mean_full_rate(answers), scores


def fixed_arms():
    """Full and Local on the split: deterministic for these prompts and settings, so cached."""
    key = hashlib.sha256(json.dumps([NAME, prompts, NEW, SINKS, WINDOW, "stop at EOS"]).encode()).hexdigest()[:16]
    path = T.CACHE_ROOT / f"{NAME}_arms_{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    arms = [list(run(oda.always_full)), list(run(oda.always_local))]
    path.write_text(json.dumps(arms))
    return arms


t0 = time.time()
full, local = fixed_arms()
print("full", full[:2], "local", local[:2], time.time() - t0, file=sys.stderr)


for width, lam, steps, seed, *more in CFG["variants"]:
    v = dict(width=width, lam=lam, steps=steps, seed=seed, tau=0.0, rounds=more[0] if more else 0,
             wd=more[1] if len(more) > 1 else 0.0, merge=more[2] if len(more) > 2 else [],
             teachers=more[3] if len(more) > 3 else 1, target=more[4] if len(more) > 4 else "gain")
    train = T.assemble(train_docs, v["lam"], v["tau"])
    dev = T.assemble(dev_docs, v["lam"], v["tau"])

    def fit(rows, v=v):
        return T.train_distilled(rows, HID, v["width"], v["steps"], 256, 1e-3, v["seed"], v["teachers"], progress=False,
                                 weight_decay=v["wd"], merge_at=tuple(v["merge"]), target=v["target"])[0]

    head = fit(train)
    for r in range(v["rounds"]):  # as train_recall_head --policy-rounds
        routed, _ = T.policy_round(ref, NAME, tasks, head, f"r{r}-{T.head_digest(head)}", train_docs, dev_docs,
                                   L, SINKS, WINDOW, Q, "greedy", 32)
        routed = T.assemble(routed, v["lam"], v["tau"])
        train = {k: torch.cat([train[k], routed[k]]) for k in train}
        head = fit(train)
    ho = T.held_out(head, dev)
    for theta in CFG["thetas"]:
        t0 = time.time()
        sc, rate, _ = run(oda.head_route(head, theta))
        gap = (sc - local[0]) / (full[0] - local[0])
        rec = dict(v, theta=theta, score=sc, rate=round(rate, 4), gap=round(gap, 4), auc=round(ho["auc_gain_positive"], 4), auc_flips=round(ho["auc_flips"], 4),
                   full=full[0], local=local[0], seed_eval=EVAL_SEED, samples=SAMPLES, new_tokens=NEW, window=WINDOW, secs=round(time.time() - t0),
                   top1_routed=round(ho["top1_routed"], 4), ho_rate=round(ho["full_rate_at_theta"], 4))
        print(json.dumps(rec), flush=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(rec) + "\n")
