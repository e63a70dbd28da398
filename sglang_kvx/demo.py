"""The main job: serve the embedded demo model, one long shared context, several questions, full vs compacted.

    sglang-kvx demo [--model tiny-hybrid-deep] [--policy gatesight] [--keep-fraction 0.3]
"""

from __future__ import annotations

import argparse
import json
import random
import time


from sglang_kvx.models.demo import DEFAULT_MODEL, DEMO_MODELS, ensure_demo_models, weights_root
from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.serve.launcher import ServerProcess

KEYS = ["river", "garden", "library", "market", "forest", "bridge"]


def build_session(n_sentences: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """A long document with a few facts hidden in filler, and one question per fact."""
    rng = random.Random(seed)
    facts = {key: str(rng.randint(10000, 99999)) for key in KEYS}
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "." for _ in range(n_sentences)]
    for key, value in facts.items():
        sentences.insert(rng.randrange(len(sentences)), f"The special magic number for {key} is {value}.")
    context = "Read the document and remember it.\n" + " ".join(sentences) + "\n"
    questions = [(f"Question: what is the special magic number for {key}? Answer: The special magic number for {key} is", value) for key, value in facts.items()]
    return context, questions


def _answer_all(server, context: str, questions, kvx: dict, max_new_tokens: int) -> tuple[int, float]:
    """Ask every question on top of the shared context; return (correct answers, mean latency)."""
    greedy = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "custom_params": {"kvx": kvx}}
    correct, latencies = 0, []
    for question, expected in questions:
        t0 = time.perf_counter()
        response = server.generate({"text": context + question, "sampling_params": greedy})
        response.raise_for_status()
        latencies.append(time.perf_counter() - t0)
        body = response.json()
        meta = body["meta_info"]
        ok = expected in body["text"]
        correct += ok
        print(
            f"  Q: {question.split('Answer:')[0].removeprefix('Question: ').strip()}\n"
            f"  A: {body['text'].strip()!r} ({'right' if ok else 'wrong, expected ' + expected}; "
            f"{latencies[-1]:.2f} s, {meta['cached_tokens']} cached of {meta['prompt_tokens']} prompt tokens)"
        )
    return correct, sum(latencies) / len(latencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-kvx demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=DEMO_MODELS)
    parser.add_argument("--policy", default="gatesight", help="policy of the compacted pass")
    parser.add_argument("--keep-fraction", default="0.3")
    parser.add_argument("--sentences", type=int, default=60, help="filler sentences in the shared context")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    ensure_demo_models()
    model_path = weights_root() / args.model
    context, questions = build_session(args.sentences, seed=0)

    print(f"[sglang-kvx demo] starting SGLang on {args.model} with --kvx-policy {args.policy} --kvx-keep-fraction {args.keep_fraction} ...", flush=True)
    server = ServerProcess(model_path, "--kvx-policy", args.policy, "--kvx-keep-fraction", str(args.keep_fraction), max_total_tokens=16384)
    with server:
        print(f"[sglang-kvx demo] server ready in {server.startup_seconds:.1f} s at {server.url} (log: {server.log_path})")
        server.flush()
        summary = {}
        for label, kvx in (("full cache", {"compact": False}), (f"{args.policy} p={args.keep_fraction}", {})):
            # The context alone, prefill only: how SGLang's frontend commits a shared prefix.
            # With a policy active this request is the parent that gets compacted.
            t0 = time.perf_counter()
            first = server.generate({"text": context, "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvx": kvx}}})
            first.raise_for_status()
            stats = server.stats()
            held = stats["kv_pool_total_tokens"] - stats["kv_pool_free_tokens"]  # the pool was empty before
            n = first.json()["meta_info"]["prompt_tokens"]
            print(f"\n[sglang-kvx demo] {label}: context of {n} tokens prefilled in {time.perf_counter() - t0:.2f} s; "
                  f"it holds {held} KV slots of the pool")
            correct, latency = _answer_all(server, context, questions, kvx, args.max_new_tokens)
            summary[label] = {"correct": f"{correct}/{len(questions)}", "kv_slots_held": held, "mean_latency_s": round(latency, 3)}
            server.flush()
        print("\n[sglang-kvx demo] summary:", json.dumps(summary))
    print("[sglang-kvx demo] server stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
