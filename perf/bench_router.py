"""Children behind SGLang's own router: how many read a compacted context, per routing policy.

    pip install sglang-router   # not a dependency of the package: only this script needs it
    OMP_NUM_THREADS=1 python perf/bench_router.py [--workers 2] [--sessions 8] [--questions 3]
                                                  [--policies round_robin,cache_aware]

Issue #44 item 3's first measurement: N real SGLang workers with the extension (tiny-llama,
KeyDiff at p = 0.1) behind the real ``sglang_router.launch_router``, one router process per routing
policy. Each session commits a document as a parent and then asks ``--questions`` children about
it, one after another, all through the router (``text`` prompts, so the router's cache-aware policy
sees the shared beginning). A child reads a compacted context only if it lands on the worker that
compacted its parent (no shared context directory yet: each worker knows its own contexts only),
so the share of children with ``meta_info.kvx[-1].child`` true is what routing alone gives.

Prints one JSON object: per policy the children that read a compacted context, those that were
served by a full prefill, and the share; plus where the parents landed. Workers and router are
started and stopped by the script; the workers are flushed between policies.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import requests

from sglang_kvx.models.demo import ensure_demo_models, weights_root
from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.serve.launcher import ServerProcess, flush_cache, free_port, server_env


def _document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


class Router:
    """``python -m sglang_router.launch_router`` over ``worker_urls`` with one routing ``policy``."""

    def __init__(self, worker_urls: list[str], policy: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"router-{policy}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--policy", policy, "--worker-urls", *worker_urls],
            stdout=self.log, stderr=subprocess.STDOUT, env=server_env())
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited ({self.proc.returncode}); its log: {self.log.name}")
            try:  # up, and its workers registered and healthy (a 503 until the router has checked them)
                probe = requests.post(self.url + "/generate", json={"text": "hello", "sampling_params": {
                    "max_new_tokens": 1}}, timeout=30)
                if probe.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the router served no request in {timeout:.0f} s; its log: {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _generate(url: str, text: str, max_new_tokens: int) -> dict:
    response = requests.post(url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0}}, timeout=300)
    response.raise_for_status()
    return response.json()


def run_policy(policy: str, workers: list[ServerProcess], sessions: int, questions: int, words: int) -> dict:
    for worker in workers:
        flush_cache(worker.url)
    router = Router([w.url for w in workers], policy)
    try:
        router.wait_ready()
        read, prefilled = 0, 0
        for session in range(sessions):
            document = _document(1000 + session, words)
            parent = _generate(router.url, document, 0)
            if not parent["meta_info"]["kvx"][-1].get("compacted"):
                raise RuntimeError(f"a parent was not compacted: {parent['meta_info']['kvx']}")
            for q in range(questions):
                child = _generate(router.url, document + f"Question {q}: which word comes next? Answer:", 4)
                if child["meta_info"].get("kvx", [{}])[-1].get("child"):
                    read += 1
                else:
                    prefilled += 1
        parents = [len(w.stats()["compacted_contexts"]) for w in workers]
    finally:
        router.stop()
    return {"children_read_compacted": read, "children_full_prefill": prefilled,
            "share_read_compacted": round(read / max(1, read + prefilled), 3), "parents_per_worker": parents}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--words", type=int, default=400, help="words per document (default: 400)")
    parser.add_argument("--policies", default="round_robin,cache_aware")
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
              "policy": "keydiff", "keep_fraction": 0.1, "shared_context_dir": False, "by_routing_policy": {}}
    with ExitStack() as stack:
        workers = [stack.enter_context(ServerProcess(path, "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.1",
                                                     "--context-length", "4096", max_total_tokens=8192))
                   for _ in range(args.workers)]
        for policy in args.policies.split(","):
            result["by_routing_policy"][policy] = run_policy(policy, workers, args.sessions, args.questions, args.words)
            print(f"[bench_router] {policy}: {result['by_routing_policy'][policy]}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
