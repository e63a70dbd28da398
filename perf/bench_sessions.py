"""Sessions per pool, measured: N shared documents x M questions against one fixed KV pool, compaction on vs off (vs tiered).

    OMP_NUM_THREADS=1 python perf/bench_sessions.py [--model tiny-hybrid-deep] [--pool 32768] [--length 2048]
        [--sessions 24] [--questions 4] [--clients 4] [--policy gatesight] [--keep-fraction 0.1] [--seed 0]
        [--arms off,on[,tiered]] [--host-store-gb 1]

Up to three arms, one real server each (run one after the other), the same workload and pool, radix cache on in all:
  - ``off``: ``--kvx-policy none`` (SGLang with the extension doing nothing);
  - ``on``: ``--kvx-policy gatesight --kvx-keep-fraction 0.1`` (every document compacted);
  - ``tiered`` (only when ``--arms`` names it): the ``on`` server plus ``--kvx-host-store-gb``
    (issue #44): a compacted context the pool evicts moves to host memory, and its next child is
    restored from there (``meta_info.kvx`` says ``restored_from: "host"``) instead of re-prefilled.
    Run it with a ``--pool`` that holds only a handful of compacted contexts and many more
    ``--sessions``: the pool alone (``on``) then re-prefills nearly every question after round 0.
The workload: ``--sessions`` documents of about ``--length`` tokens (the evaluation suite's
niah_single_2, one fact each, seed ``--seed``, sample i for session i), each asked its question
``--questions`` times, rounds interleaved round-robin (round r asks session 0, 1, ..., N-1), so the
documents compete for the pool. ``--clients`` threads take the jobs in that order; a session's jobs
never overlap. A session's first job commits its document (a prefill-only request: the parent in
the ``on`` arm, a radix-cache entry in the ``off`` arm), then every job asks ``document +
question`` (greedy, ``--max-new-tokens``).

What counts, all measured from the server's answers:
  - a *hit*: ``off`` arm: the question's ``meta_info.cached_tokens`` covers the document (>= the
    document's token count, as the committing request reported it); ``on`` arm: the question was
    served as a child of the compacted document (``meta_info.kvx`` says ``child``).
  - a *re-prefill* (``context_reprefills``): a question that was not a hit, i.e. the document had
    been evicted (wholly or partly) and was prefilled again. ``off`` arm: that question's own
    prefill re-inserts it into the radix cache. ``on`` arm: the question ran as a plain request
    (full prefill), and the client then re-sends the parent so the next questions are children
    again (``parents_resent``): one re-prefill event costs two prefills there.
  - *resident sessions* (``peak_resident_sessions``): a session is known resident from the end of
    its previous request (commit, question or re-sent parent) until the start of a question that
    hit; the peak is the most such intervals open at one moment. Misses contribute nothing (when
    the document left the pool is not observable), so this is a lower bound, the same in both arms.
    A session's first question follows its commit at once, so round 0 hits in both arms and its
    short intervals overlap about ``--clients`` deep; documents the pool holds but evicts before
    their next turn (round-robin over more documents than fit: LRU keeps none of them until reuse)
    count only there. ``peak_pool_tokens_in_use`` shows how full the pool ran meanwhile.
    The ``on`` arm also reports ``peak_store_contexts``: the most compacted contexts ``/kvx/stats``
    listed at once (polled every ``--poll`` seconds), and ``contexts_evicted`` (the store's count).
    Both arms report ``peak_pool_tokens_in_use`` (pool total - free, same polls).
  - ``questions_per_s``: questions answered / the workload's wall time (commits and re-sent
    parents included); ``latency_p50_s`` / ``latency_p99_s``: per question request, end to end.
  - ``sessions_without_reprefill``: sessions all of whose questions hit (in ``tiered`` a child
    restored from host memory is a hit: its document is not prefilled again);
    ``restored_children``: questions served as children restored from a tier. The ``tiered`` arm
    also reports ``restored_from`` (per tier) and ``/kvx/stats``' host counts at the end
    (``host_contexts_stored``, ``host_contexts_dropped``, ``host_restores``,
    ``host_restore_seconds``, ``host_contexts``, ``host_bytes``).
Prints one JSON object; with the ``tiered`` arm, ``ratios`` holds ``tiered/on`` and ``tiered/off``
of sessions_without_reprefill, questions_per_s, latency p50/p99 and context_reprefills.

``--url off=URL`` / ``--url on=URL`` / ``--url tiered=URL`` run an arm against a server already running (flushed before the
workload, used as launched): the ``off`` arm's must serve ``--kvx-policy none``, the ``on`` arm's a
compacting policy (the ``tiered`` arm's one too, with ``--kvx-host-store-gb``), which the ``on`` arm's parents then use (their requests name none), and both
arms one pool size; ``pool_tokens``, ``policy``, ``keep_fraction`` and each arm's
``server_flags`` are then the servers' own (``perf/served.py``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import add_url_option, server_or_url, urls_from_args
from served import Served, agree, describe  # perf/ is on the path when run as a script

TASK = "niah_single_2"  # one fact in a per-sample essay: documents share only the task's introduction
ARMS = ("off", "on", "tiered")
HOST_KEYS = ("host_contexts_stored", "host_contexts_dropped", "host_restores", "host_restore_seconds", "host_contexts", "host_bytes")


def build_documents(count: int, length: int, seed: int) -> list[dict]:
    from sglang_kvx.eval.tasks import generate_session

    docs = []
    for i in range(count):
        session = generate_session(TASK, length, num_questions=1, seed=seed, index=i)
        docs.append({"context": session.context, "question": session.turns[0].question, "expected": session.turns[0].answers[0]})
    return docs


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, b in intervals] + [(b, -1) for a, b in intervals], key=lambda e: (e[0], e[1]))
    open_, peak = 0, 0
    for _, step in events:
        open_ += step
        peak = max(peak, open_)
    return peak


def served_arm(name: str, url: str, args) -> Served:
    """The server at ``url`` for arm ``name``, refused unless it can run that arm of this workload."""
    served = describe(url)
    served.require_model(weights_root() / args.model)
    served.require_context(args.length + 256, f"a {args.length}-token document, its question and answer")
    if name == "off" and served.policy != "none":
        served.refuse(f"the 'off' arm needs --kvx-policy none; it serves {served.policy}")
    if name == "on" and served.policy == "none":
        served.refuse("the 'on' arm needs a compacting --kvx-policy (its parents name none); it serves none")
    if name == "tiered" and (served.policy == "none" or not served.settings.get("host_store_gb")):
        served.refuse("the 'tiered' arm needs a compacting --kvx-policy and the host tier (--kvx-host-store-gb)")
    return served


def run_arm(name: str, args, docs: list[dict], served: Served | None = None) -> dict:
    """One arm's workload on a server of its own, or on ``served`` (``--url``) as it was launched."""
    on = name in ("on", "tiered")  # tiered: the 'on' server plus the host-memory tier
    flags = ["--kvx-policy", args.policy, "--kvx-keep-fraction", str(args.keep_fraction)] if on else ["--kvx-policy", "none"]
    if name == "tiered":
        flags += ["--kvx-host-store-gb", str(args.host_store_gb)]
    server = server_or_url(served and served.url, weights_root() / args.model, *flags,
                           "--context-length", str(args.length + 256), max_total_tokens=args.pool)
    if served is not None:
        flags = [served.flags]
    kvx = {"custom_params": {"kvx": {}}} if on else {}
    state = [{"tokens": None, "since": None, "lock": threading.Lock()} for _ in docs]
    jobs = [(r, s) for r in range(args.questions) for s in range(len(docs))]  # round-robin
    next_job = iter(jobs)
    job_lock = threading.Lock()
    records: list[dict] = []
    intervals: list[tuple[float, float]] = []
    counters = {"parents_sent": 0, "parents_resent": 0, "parents_not_compacted": 0}
    counter_lock = threading.Lock()
    miss_said: dict[str, int] = {}

    def count(key: str) -> None:
        with counter_lock:
            counters[key] += 1
    peaks = {"store_contexts": 0, "pool_tokens_in_use": 0}
    done = threading.Event()
    failures: list[BaseException] = []

    def commit(s: int) -> None:
        response = server.generate({"text": docs[s]["context"], "sampling_params": {"max_new_tokens": 0, **kvx}})
        response.raise_for_status()
        meta = response.json()["meta_info"]
        state[s]["tokens"] = meta["prompt_tokens"]
        count("parents_sent")
        if on and not (meta.get("kvx") or [{}])[-1].get("compacted"):
            count("parents_not_compacted")

    def ask(s: int) -> None:
        doc, st = docs[s], state[s]
        sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, **kvx}
        start = time.perf_counter()
        response = server.generate({"text": doc["context"] + doc["question"], "sampling_params": sampling})
        end = time.perf_counter()
        response.raise_for_status()
        body = response.json()
        meta = body["meta_info"]
        restored = None
        if on:
            said = (meta.get("kvx") or [{}])[-1]
            hit, restored = bool(said.get("child")), said.get("restored_from")
        else:
            hit = meta["cached_tokens"] >= st["tokens"]
        if hit:
            intervals.append((st["since"], start))
        if on and not hit:  # what the server said about a question that was not a child (numbers left out)
            said = {k: v for k, v in ((meta.get("kvx") or [{}])[-1]).items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
            with counter_lock:
                miss_said[json.dumps(said, sort_keys=True)] = miss_said.get(json.dumps(said, sort_keys=True), 0) + 1
        records.append({"session": s, "latency": end - start, "hit": hit, "restored": restored,
                        "right": doc["expected"] in body["text"]})
        if not hit and on:  # compact it again, so the next questions are children
            commit(s)
            count("parents_resent")
        st["since"] = time.perf_counter()

    def client() -> None:
        try:
            while True:
                with job_lock:
                    job = next(next_job, None)
                if job is None or failures:
                    return
                r, s = job
                with state[s]["lock"]:
                    if r == 0:
                        commit(s)
                        state[s]["since"] = time.perf_counter()
                    ask(s)
        except BaseException as exc:  # surfaced after the join
            failures.append(exc)

    def monitor() -> None:
        while not done.wait(args.poll):
            try:
                stats = server.stats()
            except Exception:
                continue
            peaks["pool_tokens_in_use"] = max(peaks["pool_tokens_in_use"], stats["kv_pool_total_tokens"] - stats["kv_pool_free_tokens"])
            peaks["store_contexts"] = max(peaks["store_contexts"], len(stats.get("compacted_contexts", [])))

    with server:
        server.generate({"text": "warm up " * 64, "sampling_params": {"max_new_tokens": 4}}).raise_for_status()
        server.flush()
        watcher = threading.Thread(target=monitor, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done.set()
        watcher.join()
        if failures:
            raise failures[0]
        final = server.stats()
    latencies = np.array([r["latency"] for r in records])
    misses = sum(not r["hit"] for r in records)
    out = {
        "server_flags": " ".join(flags),
        "peak_resident_sessions": peak_overlap(intervals),
        "peak_pool_tokens_in_use": peaks["pool_tokens_in_use"],
        "questions": len(records),
        "wall_s": round(wall, 3),
        "questions_per_s": round(len(records) / wall, 3),
        "context_reprefills": misses,
        "reprefill_rate": round(misses / len(records), 4),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 4),
        "latency_p99_s": round(float(np.percentile(latencies, 99)), 4),
        "latency_mean_s": round(float(latencies.mean()), 4),
        "answers_right": sum(r["right"] for r in records),
        "parents_sent": counters["parents_sent"],
        "document_tokens_mean": round(float(np.mean([st["tokens"] for st in state if st["tokens"]])), 1),
        # sessions all of whose questions hit (no question of theirs re-prefilled the document)
        "sessions_without_reprefill": len({r["session"] for r in records} - {r["session"] for r in records if not r["hit"]}),
        "restored_children": sum(r["restored"] is not None for r in records),
    }
    if name == "tiered":
        out.update({key: final.get(key) for key in HOST_KEYS})
        out["restored_from"] = {tier: sum(r["restored"] == tier for r in records)
                                for tier in sorted({r["restored"] for r in records if r["restored"]})}
    if on:
        out.update({
            "peak_store_contexts": max(peaks["store_contexts"], len(final.get("compacted_contexts", []))),
            "parents_resent": counters["parents_resent"],
            "parents_not_compacted": counters["parents_not_compacted"],
            "reprefills_said": miss_said,  # meta_info.kvx of the questions that were not children, counted
            "contexts_evicted": final.get("contexts_evicted"),
            "slots_per_context_mean": round(float(np.mean([c["slots"] for c in final.get("compacted_contexts", [])] or [0])), 1),
        })
    return out


RATIO_KEYS = ("sessions_without_reprefill", "questions_per_s", "latency_p50_s", "latency_p99_s", "context_reprefills")


def ratios(arms: dict, names: list[str]) -> dict:
    """``tiered/on`` and ``tiered/off`` of the headline figures (None where the divisor is 0)."""
    out = {}
    for base in ("on", "off"):
        if base in names:
            out[f"tiered/{base}"] = {key: (round(arms["tiered"][key] / arms[base][key], 3) if arms[base][key] else None)
                                     for key in RATIO_KEYS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded demo checkpoint (default %(default)s)")
    parser.add_argument("--pool", type=int, default=32768, help="--max-total-tokens of both servers, in KV slots (default %(default)s)")
    parser.add_argument("--length", type=int, default=2048, help="tokens of a document + its question (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=24, help="documents N (default %(default)s)")
    parser.add_argument("--questions", type=int, default=4, help="questions M per document (default %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent client threads (default %(default)s)")
    parser.add_argument("--policy", default="gatesight", help="policy of the 'on' arm (default %(default)s)")
    parser.add_argument("--keep-fraction", type=float, default=0.1, help="kept fraction p of the 'on' arm (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="greedy answer tokens (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated documents (default %(default)s)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between /kvx/stats polls (default %(default)s)")
    parser.add_argument("--arms", default="off,on", help="arms to run, in order: off, on, tiered (default %(default)s)")
    parser.add_argument("--host-store-gb", type=float, default=1.0,
                        help="--kvx-host-store-gb of the 'tiered' arm's server (default %(default)s)")
    add_url_option(parser, ARMS)
    args = parser.parse_args()
    urls = urls_from_args(parser, args.url, ARMS)
    names = args.arms.split(",")
    if unused := [name for name in urls if name not in names]:
        parser.error(f"--url {unused[0]}=...: the arm does not run (--arms {args.arms})")
    ensure_demo_models()
    pool, policy, keep_fraction = args.pool, args.policy, args.keep_fraction
    served = {name: served_arm(name, url, args) for name, url in urls.items()}
    if served:  # the servers' own settings stand: one pool for every arm, the 'on' server's policy
        pools = {served[name].pool_tokens if name in served else args.pool for name in names}
        if len(pools) > 1:
            parser.error(f"the arms would run on pools of {sorted(pools)} tokens: they must share one pool size "
                         "(pass --pool to match a started arm to a --url one)")
        pool = agree(parser, args, "pool", pools.pop(), ", ".join(urls.values()))
        for name in ("on", "tiered"):
            if name in served:
                policy = agree(parser, args, "policy", served[name].policy, urls[name])
                keep_fraction = agree(parser, args, "keep_fraction", served[name].keep_fraction, urls[name])
    docs = build_documents(args.sessions, args.length, args.seed)
    result = {
        "model": args.model, "pool_tokens": pool, "length": args.length, "task": TASK, "seed": args.seed,
        "sessions": args.sessions, "questions_per_session": args.questions, "clients": args.clients,
        "policy": policy, "keep_fraction": keep_fraction,
        "arms": {name: run_arm(name, args, docs, served.get(name)) for name in names},
    }
    if "tiered" in names:
        result["ratios"] = ratios(result["arms"], names)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
