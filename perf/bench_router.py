"""Children behind SGLang's own router: how many read a compacted context, per routing policy.

    pip install sglang-router   # not a dependency of the package: only this script needs it
    OMP_NUM_THREADS=1 python perf/bench_router.py [--workers 2] [--sessions 8] [--questions 3]
                                                  [--policies round_robin,cache_aware]

Issue #44 item 3's first measurement: N real SGLang workers with the extension (tiny-llama,
KeyDiff at p = 0.1) behind the real ``sglang_router.launch_router``, one router process per routing
policy. Each session commits a document as a parent and then asks ``--questions`` children about
it, one after another, all through the router (``text`` prompts, so the router's cache-aware policy
sees the shared beginning). Two arms (``--shared-dir``): without a shared directory a child reads a
compacted context only if it lands on the worker that compacted its parent (each worker knows its
own contexts only): what routing alone gives; with one ``--kvx-context-dir`` for every worker
(``--kvx-persist-contexts on``) a child landing elsewhere restores the context from disk.

Prints one JSON object: per arm and routing policy the children that read a compacted context (and
of them those restored from disk), those served by a full prefill, and the share; plus where the
parents landed. Workers and router are started and stopped by the script; the workers are flushed
between policies (which empties the shared directory too).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from contextlib import ExitStack

import requests

from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.serve.launcher import ServerProcess, flush_cache


def _document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def _generate(url: str, text: str, max_new_tokens: int) -> dict:
    response = requests.post(url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0}}, timeout=300)
    response.raise_for_status()
    return response.json()


def run_policy(policy: str, workers: list[ServerProcess], sessions: int, questions: int, words: int) -> dict:
    for worker in workers:
        flush_cache(worker.url)
    from sglang_kvx.adapter.router import RouterProcess

    router = RouterProcess([w.url for w in workers], policy)
    try:
        router.wait_ready()
        read, prefilled, restored = 0, 0, 0
        for session in range(sessions):
            document = _document(1000 + session, words)
            parent = _generate(router.url, document, 0)
            if not parent["meta_info"]["kvx"][-1].get("compacted"):
                raise RuntimeError(f"a parent was not compacted: {parent['meta_info']['kvx']}")
            for q in range(questions):
                child = _generate(router.url, document + f"Question {q}: which word comes next? Answer:", 4)
                outcome = (child["meta_info"].get("kvx") or [{}])[-1]
                if outcome.get("child"):
                    read += 1
                    restored += outcome.get("restored_from") == "disk"
                else:
                    prefilled += 1
        parents = [len(w.stats()["compacted_contexts"]) for w in workers]
    finally:
        router.stop()
    return {"children_read_compacted": read, "children_restored_from_disk": restored, "children_full_prefill": prefilled,
            "share_read_compacted": round(read / max(1, read + prefilled), 3), "parents_per_worker": parents}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--words", type=int, default=400, help="words per document (default: 400)")
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--shared-dir", choices=("off", "on", "both"), default="both",
                        help="workers with one --kvx-context-dir (persistence on), without, or both arms (default)")
    args = parser.parse_args()
    if args.workers < 1 or args.sessions < 1 or args.questions < 1:
        parser.error("--workers, --sessions and --questions must be >= 1")
    try:
        import sglang_router  # noqa: F401 - only checked for
    except ImportError:
        parser.error("this benchmark needs SGLang's router: pip install sglang-router")
    ensure_demo_models()
    path = weights_root() / args.model
    result = {"model": args.model, "workers": args.workers, "sessions": args.sessions, "questions": args.questions,
              "policy": "keydiff", "keep_fraction": 0.1, "by_shared_dir": {}}
    arms = {"off": [False], "on": [True], "both": [False, True]}[args.shared_dir]
    for shared in arms:
        with ExitStack() as stack:
            extra = []
            if shared:  # one directory for every worker; persisted when compacted, so any worker restores it
                directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvx-contexts-"))
                extra = ["--kvx-context-dir", directory, "--kvx-persist-contexts", "on"]
            workers = [stack.enter_context(ServerProcess(path, "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.1",
                                                         "--context-length", "4096", *extra, max_total_tokens=8192))
                       for _ in range(args.workers)]
            arm = result["by_shared_dir"]["on" if shared else "off"] = {}
            for policy in args.policies.split(","):
                arm[policy] = run_policy(policy, workers, args.sessions, args.questions, args.words)
                print(f"[bench_router] shared dir {'on' if shared else 'off'}, {policy}: {arm[policy]}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
