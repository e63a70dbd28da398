"""The main job: serve the embedded demo model, send one long shared context, ask several questions.

    sglang-kvx demo [--model tiny-hybrid] [--policy none] [--keep-fraction 1.0]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-kvx demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=DEMO_MODELS)
    parser.add_argument("--policy", default="none")
    parser.add_argument("--keep-fraction", default="1.0")
    parser.add_argument("--sentences", type=int, default=150, help="filler sentences in the shared context")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    ensure_demo_models()
    model_path = weights_root() / args.model
    context, questions = build_session(args.sentences, seed=0)

    print(f"[sglang-kvx demo] starting SGLang on {args.model} (policy={args.policy}, keep_fraction={args.keep_fraction}) ...", flush=True)
    server = ServerProcess(model_path, "--kvx-policy", args.policy, "--kvx-keep-fraction", str(args.keep_fraction), max_total_tokens=16384)
    with server:
        print(f"[sglang-kvx demo] server ready in {server.startup_seconds:.1f} s at {server.url} (log: {server.log_path})")
        greedy = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}

        # The context alone, prefill only: SGLang's frontend sends exactly this to mark a shared prefix.
        t0 = time.perf_counter()
        first = server.generate({"text": context, "sampling_params": {**greedy, "max_new_tokens": 0}})
        first.raise_for_status()
        context_tokens = first.json()["meta_info"]["prompt_tokens"]
        print(f"[sglang-kvx demo] context prefilled: {context_tokens} tokens, first request {time.perf_counter() - t0:.2f} s")

        for question, expected in questions:
            t0 = time.perf_counter()
            response = server.generate({"text": context + question, "sampling_params": greedy})
            response.raise_for_status()
            body = response.json()
            meta = body["meta_info"]
            print(
                f"  Q: {question.split('Answer:')[0].removeprefix('Question: ').strip()}\n"
                f"  A: {body['text']!r} (expected {expected}; {time.perf_counter() - t0:.2f} s, "
                f"{meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens from cache)"
            )
        print("[sglang-kvx demo] /kvx/stats:", json.dumps(server.stats()))
    print("[sglang-kvx demo] server stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
