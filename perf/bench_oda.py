"""On-Demand Attention's decode speed against Full attention, per context length (seed 003, Table 19's protocol).

    OMP_NUM_THREADS=1 python perf/bench_oda.py [--model tiny-llama] [--lengths 1024,4096,16384,32768]
        [--new-tokens 64] [--window 128] [--head DIR] [--prompts random|TASK]

One real server with decode steps on. Per context length, one prompt (``--prompts random``: random
token ids; or a task of the evaluation suite, e.g. ``niah_single_1``: its seed-0 sample of that
length, context then question, the text a trained head saw in training) is prefilled once (the
prefix cache then holds it: every arm below decodes from the same cached prompt) and decoded,
single request, greedy, under:
  - ``full``: plain decoding (no decode step);
  - ``local_first`` at fixed Full-call rates 0, 12.5, 50 and 100% (``span_schedule`` with
    ``full_every`` 2^24, 8, 2, 1: every step runs Local first; the scheduled ones re-run Full from
    the restored pre-step state, exactly the work ODA does when its head picks them);
  - ``oda``: the recall head routing (``--head``, default the head trained for the model; with
    none, a head of the same shape with seeded random weights, labelled so: its time is the head's
    cost, its routing says nothing about quality).
Each arm's per-step decode time is read from a streamed response: the time between its first and
last streamed token over the tokens between them (prefill and admission come before the first). Prints one JSON object: per length and arm the
per-step seconds and the speedup over ``full`` (ratios measured in one run), the crossover length
(the shortest where the 0%-rate arm beats ``full``), and the FLOPs each arm's schedule implies
(``sglang_kvx.decode.flops``, Eqs. 24-25 of the seed: computed, not measured). Also the cost of one
head scoring and of one row's GDN state snapshot + restore, as fractions of a Local step.

``--url URL`` runs against a server already running (used as launched): it must serve the model,
decode steps on and no default step (``full`` is plain decoding), a context of the longest length
plus the new tokens, and a recall head, whose folder (its ``--kvx-oda-head``, else the one found for
its model) is then the head timed and reported (``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import requests
import torch
from tqdm import tqdm

from sglang_kvx.decode.oda import find_head
from sglang_kvx.decode.flops import oda_flops
from sglang_kvx.decode.recall_head import RecallHead, config_hash, load_model_config
from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

NEVER = 1 << 24
RATES = {"local_first_0": NEVER, "local_first_12.5": 8, "local_first_50": 2, "local_first_100": 1}


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def decode_seconds_per_step(url: str, body: dict) -> tuple[float, dict]:
    """Stream the request: seconds between its first and last streamed token over the steps between
    them (the decode steps alone: the prompt's admission and prefill are before the first), and the
    final chunk's body."""
    stamps, counts, last = [], [], {}
    with requests.post(url + "/generate", json={**body, "stream": True}, timeout=3600, stream=True) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            last = json.loads(line[5:])
            stamps.append(time.perf_counter())
            counts.append(last["meta_info"]["completion_tokens"])
    return (stamps[-1] - stamps[0]) / max(1, counts[-1] - counts[0]), last


def suite_prompt(model_path: Path, task: str, n: int) -> list[int]:
    """The suite's seed-0 sample of ``task`` at ``n`` tokens, context then question, as token ids."""
    from transformers import AutoTokenizer

    from sglang_kvx.eval.tasks import generate_sample

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    sample = generate_sample(task, n, seed=0, index=0, tokenizer=tokenizer)
    return tokenizer.encode(sample.context + sample.question)


def timed(url: str, body: dict) -> float:
    t0 = time.perf_counter()
    requests.post(url + "/generate", json=body, timeout=3600).raise_for_status()
    return time.perf_counter() - t0


def seeded_head(model_path: Path, out: Path, sinks: int, window: int) -> Path:
    cfg = load_model_config(model_path)
    torch.manual_seed(0)
    head = RecallHead(cfg["hidden_size"])
    for parameter in head.parameters():
        parameter.data.normal_(0, 0.3)
    head.save_pretrained(out, {"model": {"name": model_path.name, "hidden_size": cfg["hidden_size"],
                                         "vocab_size": cfg["vocab_size"], "config_hash": config_hash(cfg)},
                               "sinks": sinks, "window": window, "note": "seeded random weights (perf only)"})
    return out


def per_step_costs(model_path: Path, head_dir: Path, repeats: int = 200) -> dict:
    """One head scoring (one row) and one row's state snapshot + restore (hybrids), in seconds."""
    from sglang_kvx.ops.state_snapshot import restore_states, snapshot_states

    cfg = load_model_config(model_path)
    head = RecallHead.from_pretrained(head_dir, model_path)
    x = torch.randn(1, cfg["hidden_size"])
    with torch.no_grad():
        for _ in range(10):
            head(x, x, x)
        t0 = time.perf_counter()
        for _ in range(repeats):
            head(x, x, x)
    costs = {"head_s": (time.perf_counter() - t0) / repeats}
    layers = [t for t in cfg.get("layer_types", []) if t == "linear_attention"]
    if layers:  # GDN temporal [L, slots, H, K, V] and conv [L, slots, channels, kernel - 1] states
        heads, k, v = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        channels = 2 * cfg["linear_num_key_heads"] * k + heads * v
        states = [torch.randn(len(layers), 64, channels, cfg["linear_conv_kernel_dim"] - 1),
                  torch.randn(len(layers), 64, heads, k, v)]
        slots = torch.tensor([5])
        t0 = time.perf_counter()
        for _ in range(repeats):
            restore_states(states, slots, snapshot_states(states, slots, slot_dim=1), slot_dim=1)
        costs["snapshot_restore_s"] = (time.perf_counter() - t0) / repeats
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--lengths", default="1024,4096,16384,32768")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--head", default="")
    parser.add_argument("--theta", type=float, default=0.0, help="the head's threshold (default: the paper's 0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm (the median is kept)")
    parser.add_argument("--out", default="", help="also write the JSON object here, after every length")
    parser.add_argument("--prompts", default="random",
                        help="random (token ids) or a suite task, e.g. niah_single_1 (its sample of each length)")
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    from sglang_kvx.eval.tasks import TASKS

    if args.prompts != "random" and args.prompts not in TASKS:
        parser.error(f"--prompts must be random or a suite task ({', '.join(TASKS)}), got {args.prompts!r}")
    ensure_demo_models()
    path = weights_root() / args.model
    lengths = [int(n) for n in args.lengths.split(",")]
    cfg = load_model_config(path)
    top = max(lengths) + args.new_tokens + 64
    if url:  # the server's own head is the one routing and timed
        served = describe(url)
        served.require_model(path)
        served.require_plain_decoding()
        served.require_context(top, f"a {max(lengths)}-token prompt and {args.new_tokens} new tokens")
        served.require_pool(2 * top + 512, "keeping the longest prompt cached for every arm")
        head_dir = served.oda_head
        if not head_dir:
            served.refuse("it serves no recall head (--kvx-oda-head): the oda arm needs one")
        if args.head and Path(args.head).resolve() != Path(head_dir).resolve():
            parser.error(f"--head {args.head}: the server at {url} serves the head in {head_dir} (drop --head)")
        note = json.loads((Path(head_dir) / "manifest.json").read_text()).get("note")
        head_note = f"the server's head {head_dir}" + (f" ({note})" if note else "")
    else:
        head_dir = args.head or find_head(str(path))
        head_note = "trained head" if head_dir else "seeded random head (cost only)"
        if not head_dir:
            head_dir = str(seeded_head(path, Path(tempfile.mkdtemp()) / "head", args.sinks, args.window))
    # A long prefill chunk of a real model runs for minutes on CPU: past SGLang's 300 s watchdog, which
    # kills the scheduler (SmolLM2's fourth 8K chunk at 32K did).
    server = server_or_url(url, path, "--kvx-decode-steps", "on", "--kvx-oda-head", head_dir, "--context-length", str(top),
                           "--chunked-prefill-size", "8192", "--watchdog-timeout", "7200",
                           max_total_tokens=2 * top + 512,  # the cached prompt never evicted
                           env={"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"})
    span = {"sinks": args.sinks, "window": args.window}
    arms = {"full": None, **{name: {"step": "span_schedule", **span, "full_every": every} for name, every in RATES.items()},
            "oda": {"step": "oda", **span, "theta": args.theta}}
    result: dict = {"model": args.model, "new_tokens": args.new_tokens, "sinks": args.sinks, "window": args.window,
                    "head": head_note, "theta": args.theta, "prompts": args.prompts, "lengths": {}}
    try:
        server.start()
        for n in tqdm(lengths, desc="context lengths"):
            ids = prompt(n, n, cfg["vocab_size"]) if args.prompts == "random" else suite_prompt(path, args.prompts, n)
            timed(server.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})  # prefill once: cached
            row: dict = {}
            for name, decode in arms.items():
                per_step, full_rate = [], None
                for _ in range(args.repeats):
                    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
                    if decode is not None:
                        sampling["custom_params"] = {"kvx": {"decode": decode}}
                    seconds, body = decode_seconds_per_step(server.url, {"input_ids": ids, "sampling_params": sampling})
                    per_step.append(seconds)
                    report = (body.get("meta_info", {}).get("kvx") or [{}])[-1]
                    full_rate = report.get("full_rate", full_rate)
                steps = args.new_tokens - 1
                if name == "full":
                    schedule = [True] * steps
                elif name == "oda":
                    schedule = [i < round(full_rate * steps) for i in range(steps)]  # the rate it realised
                else:
                    every = RATES[name]
                    schedule = [(t % every) == 0 for t in range(1, steps + 1)]
                flops = oda_flops(cfg, n, schedule, sinks=args.sinks, window=args.window)
                row[name] = {"per_step_s": round(statistics.median(per_step), 6),
                             "flops_per_step": (flops["full_flops"] if name == "full" else flops["oda_flops"]) / steps}
                if name == "oda":
                    row[name]["full_rate"] = full_rate
            for name in arms:
                own = row[name]["per_step_s"]  # 0 only if the stream came in one chunk (no step between chunks)
                row[name]["speedup_over_full"] = round(row["full"]["per_step_s"] / own, 4) if own > 0 else None
                row[name]["flops_ratio_to_full"] = round(row[name]["flops_per_step"] / row["full"]["flops_per_step"], 4)
            result["lengths"][n] = row
            if args.out:  # what each length measured survives a later failure
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        server.stop()
    faster = [n for n in lengths if (result["lengths"][n]["local_first_0"]["speedup_over_full"] or 0) > 1.0]
    result["crossover_length"] = min(faster) if faster else None
    costs = per_step_costs(path, Path(head_dir))
    local_step = result["lengths"][min(lengths)]["local_first_0"]["per_step_s"]
    result["head_cost_fraction_of_local_step"] = round(costs["head_s"] / local_step, 4)
    if "snapshot_restore_s" in costs:
        result["snapshot_cost_fraction_of_local_step"] = round(costs["snapshot_restore_s"] / local_step, 4)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
