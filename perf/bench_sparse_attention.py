"""Block-sparse attention and QSA regrouping: accuracy, index size and indexer scan time (issue 17).

    OMP_NUM_THREADS=1 python perf/bench_sparse_attention.py [--model tiny-hybrid-deep] [--length 2048]
        [--tasks ...] [--samples 4] [--budget 256] [--fraction 0.1] [--index-fractions 0.5,0.2,0.1]
        [--index-lengths 2048,4096,8192,16384] [--scan-lengths 2048,4096,8192,16384] [--scan-rows 1,16]
        [--scan-shapes model,16x2x256]

In one run:
1. Accuracy on the suite (``sglang_kvx.eval``'s sessions, seed 0) from two real servers on the same
   model: dense attention and ``--kvx-sparse-attention BUDGET``; each over the full cache and over
   contexts compacted by ``--policy`` (GateSight by default) at ``--fraction`` (the sparse server's children read each layer's
   kept entries regrouped into new blocks). Target: regrouped sparse within 5 points of sparse over
   the full cache.
2. Index size, measured from the dense server (which compacts exactly as the sparse one; the
   indexer's blocks are ceil(K_l / 4) per KV head for the K_l entries layer l kept, which is what
   the sparse server's ``/kvx/stats`` reports and its tests check): one suite context of each of
   ``--index-lengths`` tokens compacted by the policy at each of ``--index-fractions``, the blocks each
   layer's indexer scans for the full context and for its regrouped kept entries, against p * n / 4.
3. Indexer scan time per decode step (the kernel layer's ``select_blocks``, torch reference on this
   machine; a decode batch of each of ``--scan-rows`` rows, one query each, at the model's attention
   shape and each other of ``--scan-shapes``, random keys): the full index of n / 4 blocks per row against the regrouped index
   of the kept fraction, at each of ``--scan-lengths``, median of ``--repeats``; and per row count a
   least-squares line seconds = fixed + per_block * blocks over all its points, which separates the
   per-call cost from the part that scales with the index. Prints one JSON object.

``--url dense=URL`` / ``--url sparse=URL`` run an arm on a server already running (used as launched;
requests name their policy): the dense arm's must attend densely and hold the longest index context,
the sparse arm's must run ``--kvx-sparse-attention``, whose budget is then the one reported and
scanned (``--budget`` may only repeat it), both the model and a context of ``--length`` plus the
answer (``perf/served.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
import time
from pathlib import Path

import requests
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_kvx.eval.runner import evaluate, summarize
from sglang_kvx.eval.tasks import generate_sample
from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.ops.block_sparse import BLOCK, select_blocks
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import agree, describe  # perf/ is on the path when run as a script

ARMS = ("dense", "sparse")
DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multiquery,niah_multivalue,vt,qa_1"


def index_sizes(url: str, context_ids: list[int], fractions: list[float], policy: str) -> dict[str, dict]:
    """Per kept fraction: the blocks each layer's indexer scans, full context and regrouped."""
    sizes = {}
    for p in fractions:
        body = {"input_ids": context_ids, "sampling_params": {
            "max_new_tokens": 0, "custom_params": {"kvx": {"policy": policy, "keep_fraction": p}}}}
        response = requests.post(url + "/generate", json=body, timeout=600)
        response.raise_for_status()
        stats = requests.get(url + "/kvx/stats", timeout=30).json()
        entries = [c for c in stats["compacted_contexts"] if c["keep_fraction"] == p and c["context_tokens"] == len(context_ids)]
        if not entries:
            raise RuntimeError(f"the {len(context_ids)}-token context was not compacted at p = {p:g} (see the server log; "
                               f"last compaction error: {stats['last_compaction_error']})")
        entry = entries[-1]
        regrouped = [-(-kept // BLOCK) for kept in entry["kept_entries"]]
        target = p * len(context_ids) / BLOCK
        sizes[f"{p:g}"] = {"context_tokens": len(context_ids), "full_context_blocks": -(-len(context_ids) // BLOCK),
                           "regrouped_blocks_per_layer": regrouped,
                           "regrouped_mean": statistics.mean(regrouped), "p_n_over_4": target,
                           "mean_vs_target": statistics.mean(regrouped) / target}
    return sizes


def scan_seconds(blocks: int, rows: int, kv_heads: int, heads: int, head_dim: int, budget_blocks: int,
                 repeats: int) -> float:
    """Median seconds of one decode step's block selection: ``rows`` rows, one query each, each row
    over its own index of ``blocks`` compressed keys (laid out one row after another, as served)."""
    gen = torch.Generator().manual_seed(blocks * 131 + rows)
    keys = torch.randn(rows * blocks, kv_heads, head_dim, generator=gen)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    lo = torch.arange(rows) * blocks
    hi = lo + blocks
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        select_blocks(q, keys, lo, hi, budget_blocks, 1, head_dim ** -0.5, impl="torch")
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # two warm-up calls


def fit_line(points: list[tuple[int, float]]) -> dict[str, float]:
    """Least squares seconds = fixed + per_block * blocks (computed from the measured points)."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"fixed_seconds": mean_y - slope * mean_x, "seconds_per_block": slope}


def scan_table(lengths: list[int], fractions: list[float], rows: int, shape: tuple[int, int, int],
               budget_blocks: int, repeats: int) -> dict:
    heads, kv_heads, head_dim = shape
    table: dict = {}
    points = []
    for n in lengths:
        blocks = -(-n // BLOCK)
        full = scan_seconds(blocks, rows, kv_heads, heads, head_dim, budget_blocks, repeats)
        points.append((blocks * rows, full))
        row = {"full_index_seconds": full}
        for p in fractions:
            kept_blocks = -(-int(p * n) // BLOCK)
            seconds = scan_seconds(kept_blocks, rows, kv_heads, heads, head_dim, budget_blocks, repeats)
            points.append((kept_blocks * rows, seconds))
            row[f"p{p:g}"] = {"seconds": seconds, "vs_full": seconds / full, "index_vs_full": kept_blocks / blocks}
        table[str(n)] = row
    if len({x for x, _ in points}) > 1:
        table["fit_over_blocks_scanned"] = fit_line(points)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid-deep", help="model folder under weights/ or a path (default: tiny-hybrid-deep)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per prompt (default: 2048)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"suite tasks (default: {DEFAULT_TASKS})")
    parser.add_argument("--samples", type=int, default=4, help="contexts per task (default: 4)")
    parser.add_argument("--budget", type=int, default=256, help="tokens each query attends to in sparse mode (default: 256)")
    parser.add_argument("--policy", default="gatesight", help="compaction policy (default: gatesight; a dense model: e.g. snapkv)")
    parser.add_argument("--fraction", type=float, default=0.1, help="the policy's kept fraction for the accuracy arms (default: 0.1)")
    parser.add_argument("--index-fractions", default="0.5,0.2,0.1", help="kept fractions for the index sizes (default: 0.5,0.2,0.1)")
    parser.add_argument("--index-lengths", default="2048,4096,8192,16384",
                        help="context lengths for the index sizes (default: 2048,4096,8192,16384)")
    parser.add_argument("--scan-lengths", default="2048,4096,8192,16384", help="context lengths for the scan timing")
    parser.add_argument("--scan-rows", default="1,16", help="decode rows per timed scan (default: 1,16)")
    parser.add_argument("--scan-shapes", default="model,16x2x256",
                        help="attention shapes the scan is timed at: 'model' (the model's own) and HQxHKVxD entries "
                             "(default: model,16x2x256, Qwen3-Next's attention layers)")
    parser.add_argument("--repeats", type=int, default=20, help="timed scans per point (default: 20)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per answer (default: 24)")
    add_url_option(parser, ARMS)
    args = parser.parse_args()
    urls = urls_from_args(parser, args.url, ARMS)
    ensure_demo_models()
    path = Path(args.model) if args.model.startswith(("/", ".")) else weights_root() / args.model
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tasks = [t for t in args.tasks.split(",") if t]
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    own = (heads, text["num_key_value_heads"], text.get("head_dim") or text["hidden_size"] // heads)
    shapes = {}
    for name in [x for x in args.scan_shapes.split(",") if x]:
        shape = own if name == "model" else tuple(int(x) for x in name.split("x") if x.isdigit())
        if len(shape) != 3 or shape[0] % shape[1]:
            parser.error(f"--scan-shapes entries are 'model' or HQxHKVxD with HQ a multiple of HKV, got {name!r}")
        shapes[f"{shape[0]}x{shape[1]}x{shape[2]}"] = shape
    fractions = [float(f) for f in args.index_fractions.split(",") if f]
    index_lengths = [int(x) for x in args.index_lengths.split(",") if x]
    context_length = args.length + args.max_new_tokens + 128
    server_args = ("--kvx-policy", args.policy)
    # The dense server also holds the longest index context (its compaction is the sparse one's).
    longest = {"dense": max([context_length, *(n + 128 for n in index_lengths)]), "sparse": context_length}
    budget = args.budget
    for arm, url in urls.items():
        served = describe(url)
        served.require_model(path)
        served.require_context(longest[arm], "the " + ("longest index context" if arm == "dense" else "prompts"))
        if arm == "dense" and served.sparse_budget:
            served.refuse(f"the dense arm needs dense attention; it runs --kvx-sparse-attention {served.sparse_budget}")
        if arm == "sparse":
            if not served.sparse_budget:
                served.refuse("the sparse arm needs --kvx-sparse-attention; it attends densely")
            budget = agree(parser, args, "budget", served.sparse_budget, url)
    result: dict = {"model": args.model, "length": args.length, "tasks": tasks, "samples_per_task": args.samples,
                    "budget_tokens": budget, "policy": args.policy, "fraction": args.fraction, "accuracy": {}}
    for arm, extra in (("dense", ()), ("sparse", ("--kvx-sparse-attention", str(budget)))):
        with server_or_url(urls.get(arm), path, *server_args, *extra, "--context-length", str(longest[arm]),
                           max_total_tokens=max(8 * context_length, 4 * longest[arm])) as server:
            rows = evaluate(server.url, tasks, args.length, args.samples, [args.policy], [args.fraction],
                            max_new_tokens=args.max_new_tokens, tokenizer=tokenizer)
            means = summarize(rows)
            result["accuracy"][arm] = {"full_cache": means[("full", 1.0)],
                                       f"{args.policy}_p{args.fraction:g}": means[(args.policy, args.fraction)],
                                       "per_task": rows}
            if arm == "dense":
                result["index_sizes"] = {}
                for n in tqdm(index_lengths, desc="index sizes"):
                    sample = generate_sample(tasks[0], n, seed=0, index=0, tokenizer=tokenizer)
                    result["index_sizes"][str(n)] = index_sizes(server.url, tokenizer.encode(sample.context),
                                                                fractions, args.policy)
    sparse = result["accuracy"]["sparse"]
    result["regrouped_minus_sparse_full"] = round(sparse[f"{args.policy}_p{args.fraction:g}"] - sparse["full_cache"], 2)
    scan_lengths = [int(x) for x in args.scan_lengths.split(",") if x]
    scan_rows = [int(x) for x in args.scan_rows.split(",") if x]
    result["model_shape"] = "{}x{}x{}".format(*own)
    result["scan_per_decode_step"] = {
        name: {f"rows{rows}": scan_table(scan_lengths, fractions, rows, shape, budget // BLOCK, args.repeats)
               for rows in scan_rows}
        for name, shape in tqdm(shapes.items(), desc="scan timing")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
