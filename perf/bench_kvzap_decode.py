"""KVzap's decode step against StreamingLLM at the same kept fraction, on long generations (issue #57 item 7).

    OMP_NUM_THREADS=1 python perf/bench_kvzap_decode.py [--model smollm2-135m-instruct] [--length 1024] \\
        [--tasks niah_single_1,niah_single_2,niah_multivalue] [--samples 10] [--max-new-tokens 256] \\
        [--window 128] [--thresholds=-4.8] [--kind mlp]

One server with decode steps on. Every sample of the evaluation suite (seed 0, index 0..samples-1; the
surrogates were trained on other seeds) is its context and question, answered greedily for exactly
``--max-new-tokens`` tokens (EOS ignored: every arm generates as long, and the step's decisions keep
coming) under
  - ``full``: plain decoding;
  - ``kvzap@tau``: the ``kvzap`` decode step (the prompt's tokens scored in its prefill and each new one
    when written; entries leaving the ``--window`` dropped for good where their predicted log KVzip+
    is under tau; the row's own decided stretch re-folded and its slots given back);
  - ``streamingllm@tau``: 4 sinks and a window sized per sample so that it reads as many entries at the
    last step as ``kvzap@tau`` kept there (same kept fraction, per sample).
Per arm: the suite score of the text (RULER metric x 100 on ``postprocess``ed answers: the answer must
come first), the share of generated tokens equal to the full arm's at the same position, the mean
kept fraction at the last step (KVzap: its report's ``kept_fraction``, entries kept over layers and KV
heads; StreamingLLM: (sinks + window) / keys), and the pool slots each request gave back while it ran
(KVzap: its report's ``slots_freed``, own slots given back less its fold's; StreamingLLM: the server's
``decode_slots_freed`` delta). One JSON object on stdout. ``--url URL`` runs against a server already
running (used as launched: decode steps on, no default step, the model; ``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import requests
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_kvx.eval.scoring import METRICS, postprocess
from sglang_kvx.eval.tasks import generate_sample
from sglang_kvx.models.demo import weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import describe  # perf/ is on the path when run as a script

SINKS = 4


def generate(url: str, ids: list[int], decode: dict | None, new_tokens: int) -> dict:
    sampling = {"temperature": 0.0, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "ignore_eos": True}
    if decode is not None:
        sampling["custom_params"] = {"kvx": {"decode": decode}}
    response = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=3600)
    response.raise_for_status()
    return response.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multivalue")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--thresholds", default="", help="taus (default: the surrogate manifest's); write --thresholds=-5,-4")
    parser.add_argument("--kind", choices=("mlp", "linear"), default="mlp")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="--disable-radix-cache: a request then owns its prompt's slots, so both steps can give "
                             "the prompt's back too (with the cache the prompt stays, shared, and is only masked)")
    add_url_option(parser, ("server",))
    args = parser.parse_args()
    url = urls_from_args(parser, args.url, ("server",)).get("server")
    path = weights_root() / args.model
    if url:  # used as launched: it must serve the model, with decode steps on and no default step
        served = describe(url)
        served.require_model(path)
        served.require_plain_decoding()
        served.require_context(args.length + args.max_new_tokens + 64, "a prompt and its generation")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tasks = [t for t in args.tasks.split(",") if t]
    samples = []
    for task in tasks:
        for i in range(args.samples):
            sample = generate_sample(task, args.length, seed=0, index=i, tokenizer=tokenizer)
            samples.append((task, sample, tokenizer(sample.context + sample.question).input_ids))
    step = "kvzap" if args.kind == "mlp" else "kvzap_linear"
    taus = [float(t) for t in args.thresholds.split(",") if t] or [None]
    server = server_or_url(url, path, "--kvx-decode-steps", "on", *(["--disable-radix-cache"] if args.no_prefix_cache else []),
                           "--context-length",
                           str(args.length + args.max_new_tokens + 256), max_total_tokens=4 * (args.length + args.max_new_tokens))
    arms: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    with server:
        full = []
        for task, sample, ids in tqdm(samples, desc="full"):
            body = generate(server.url, ids, None, args.max_new_tokens)
            full.append(body["output_ids"])
            arms["full"]["score"].append(METRICS[task](postprocess(body["text"]), sample.answers))
            arms["full"]["agreement"].append(1.0)
            arms["full"]["kept_fraction"].append(1.0)
            arms["full"]["slots_freed"].append(0)
        for tau in taus:
            name = f"{step}@{'manifest' if tau is None else f'{tau:g}'}"
            decode = {"step": step, "window": args.window, **({} if tau is None else {"threshold": tau})}
            for (task, sample, ids), reference in zip(tqdm(samples, desc=name), full):
                body = generate(server.url, ids, decode, args.max_new_tokens)
                report = [e for e in body["meta_info"]["kvx"] if e.get("decode") == step][-1]
                arm = arms[name]
                arm["score"].append(METRICS[task](postprocess(body["text"]), sample.answers))
                arm["agreement"].append(sum(a == b for a, b in zip(body["output_ids"], reference)) / len(reference))
                arm["kept_fraction"].append(report["kept_fraction"])
                arm["slots_freed"].append(report["slots_freed"])
                arm["threshold"] = [report["threshold"]]
                # StreamingLLM reading as many entries at the last step: (sinks + window) = kept * keys.
                keys = len(ids) + args.max_new_tokens - 1
                window = max(1, round(report["kept_fraction"] * keys) - SINKS)
                before = server.stats()["decode_slots_freed"]
                body = generate(server.url, ids, {"step": "streamingllm", "sinks": SINKS, "window": window}, args.max_new_tokens)
                other = arms[f"streamingllm@{name.split('@')[1]}"]
                other["score"].append(METRICS[task](postprocess(body["text"]), sample.answers))
                other["agreement"].append(sum(a == b for a, b in zip(body["output_ids"], reference)) / len(reference))
                other["kept_fraction"].append(min(1.0, (SINKS + window) / keys))
                other["slots_freed"].append(server.stats()["decode_slots_freed"] - before)
    result = {"model": args.model, "length": args.length, "tasks": tasks, "samples_per_task": args.samples, "seed": 0,
              "prefix_cache": None if url else not args.no_prefix_cache,  # None: the server's own setting
              "max_new_tokens": args.max_new_tokens, "window": args.window, "sinks": SINKS, "kind": args.kind, "arms": {}}
    for name, arm in arms.items():
        result["arms"][name] = {
            "score": round(100 * sum(arm["score"]) / len(arm["score"]), 2),
            "token_agreement_with_full": round(sum(arm["agreement"]) / len(arm["agreement"]), 4),
            "kept_fraction": round(sum(arm["kept_fraction"]) / len(arm["kept_fraction"]), 4),
            "slots_freed_per_request": round(sum(arm["slots_freed"]) / len(arm["slots_freed"]), 1),
            **({"threshold": arm["threshold"][0]} if arm.get("threshold") else {}),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
