"""The main job: serve the embedded demo model, one long shared context, several questions, full vs compacted.

    sglang-kvx demo [--model tiny-hybrid-deep] [--policy gatesight] [--keep-fraction 0.3]
"""

from __future__ import annotations

import argparse
import json
import time


from sglang_kvx.models.demo import DEFAULT_MODEL, DEMO_MODELS, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import ServerProcess



def build_session(length: int, seed: int, num_questions: int = 4) -> tuple[str, list[tuple[str, str]]]:
    """One long document with several keyed facts hidden in an essay, and one question per fact:
    the evaluation suite's multi-key needle task in its shared-context (SCBench) mode."""
    from sglang_kvx.eval.tasks import generate_session

    session = generate_session("niah_multikey_1", length, num_questions=num_questions, seed=seed)
    return session.context, [(turn.question, turn.answers[0]) for turn in session.turns]


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
            f"  Q: {question.split('?')[0].strip()}?\n"
            f"  A: {body['text'].strip()!r} ({'right' if ok else 'wrong, expected ' + expected}; "
            f"{latencies[-1]:.2f} s, {meta['cached_tokens']} cached of {meta['prompt_tokens']} prompt tokens)"
        )
    return correct, sum(latencies) / len(latencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-kvx demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=DEMO_MODELS)
    parser.add_argument("--policy", default="gatesight", help="policy of the compacted pass")
    parser.add_argument("--keep-fraction", default="0.3")
    parser.add_argument("--length", type=int, default=1536, help="tokens of context + question")
    parser.add_argument("--questions", type=int, default=4, help="questions asked of the one shared context")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    ensure_demo_models()
    model_path = weights_root() / args.model
    context, questions = build_session(args.length, seed=0, num_questions=args.questions)

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
