"""The main job: serve the embedded demo model, several shared documents (sessions) asked by concurrent clients, full vs compacted.

    sglang-kvx demo [--model tiny-hybrid-deep] [--policy gatesight] [--keep-fraction 0.1]
        [--sessions 4] [--clients 3] [--length 2048]

Each session is one long document holding one fact (the evaluation suite's single-needle task
niah_single_2: a number hidden in a generated essay; the demo model answers it 6/6 at 2K on the full
cache, seed 0, samples 0-5). Every document is its own essay, so the radix cache shares only the
task's one-line introduction between them. One server runs both arms in turn:
  - full cache: every document committed uncompacted (a prefill-only request with
    ``custom_params.kvx.compact = false``), held by SGLang's radix cache;
  - compacted: every document committed as a parent, compacted by the server's policy.
In each arm ``--clients`` threads ask every session's question concurrently (one question per
client and session, each client starting at another session), as children of the committed
document. The closing table: KV slots a session holds (measured from the pool), how many sessions
the pool holds each way (computed from those slots), mean latency of a question (measured), and
how many answers were right.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_kvx.models.demo import DEFAULT_MODEL, DEMO_MODELS, ensure_demo_models, weights_root
from sglang_kvx.serve.launcher import ServerProcess

# A single-needle task the demo model solves; its essay haystack differs per sample (niah_single_1's
# repeated-noise haystack would let the radix cache share most of one document with the next).
TASK = "niah_single_2"


def build_sessions(count: int, length: int, seed: int = 0) -> list[dict]:
    """``count`` documents of about ``length`` tokens (context + question), one fact and one question each."""
    from sglang_kvx.eval.tasks import generate_session

    sessions = []
    for i in range(count):
        session = generate_session(TASK, length, num_questions=1, seed=seed, index=i)
        turn = session.turns[0]
        needle = session.metadata["needles"][0]
        sessions.append({
            "name": f"session {i + 1}",
            "tokens": session.metadata["context_length"],
            "context": session.context,
            "question": turn.question,
            "expected": turn.answers[0],
            "depth": needle["depth"],
        })
    return sessions


def _commit(server: ServerProcess, session: dict, kvx: dict) -> tuple[int, float]:
    """Send the document alone, prefill only (how SGLang's frontend commits a shared prefix): with a
    policy active it is the parent that gets compacted. Returns (KV slots it holds, seconds)."""
    before = server.stats()["kv_pool_free_tokens"]
    t0 = time.perf_counter()
    response = server.generate({"text": session["context"], "sampling_params": {"max_new_tokens": 0, "custom_params": {"kvx": kvx}}})
    response.raise_for_status()
    seconds = time.perf_counter() - t0
    return before - server.stats()["kv_pool_free_tokens"], seconds


def _ask(server: ServerProcess, session: dict, kvx: dict, max_new_tokens: int) -> dict:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "custom_params": {"kvx": kvx}}
    t0 = time.perf_counter()
    response = server.generate({"text": session["context"] + session["question"], "sampling_params": sampling})
    response.raise_for_status()
    seconds = time.perf_counter() - t0
    body = response.json()
    text = body["text"].strip()
    return {"text": text, "right": session["expected"] in text, "seconds": seconds,
            "cached": body["meta_info"]["cached_tokens"], "prompt": body["meta_info"]["prompt_tokens"]}


def run_arm(server: ServerProcess, sessions: list[dict], kvx: dict, clients: int, max_new_tokens: int) -> dict:
    """Commit every session, then let ``clients`` threads ask every session's question concurrently."""
    server.flush()
    slots, commit_s = [], []
    for session in sessions:
        held, seconds = _commit(server, session, kvx)
        slots.append(held)
        commit_s.append(seconds)

    def client(k: int) -> list[tuple[int, dict]]:
        order = [(k + j) % len(sessions) for j in range(len(sessions))]  # each client starts elsewhere
        return [(i, _ask(server, sessions[i], kvx, max_new_tokens)) for i in order]

    answers: list[list[dict]] = [[None] * clients for _ in sessions]  # type: ignore[list-item]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for k, replies in enumerate(pool.map(client, range(clients))):
            for i, reply in replies:
                answers[i][k] = reply
    wall = time.perf_counter() - t0
    flat = [a for row in answers for a in row]
    server.flush()
    return {"slots": slots, "commit_s": commit_s, "answers": answers, "wall_s": wall,
            "latency_s": statistics.mean(a["seconds"] for a in flat),
            "right": sum(a["right"] for a in flat), "asked": len(flat)}


def _shown(replies: list[dict]) -> str:
    texts = [r["text"] for r in replies]
    right = sum(r["right"] for r in replies)
    if len(set(texts)) == 1:
        return f"{texts[0]!r:16} x{len(texts)} clients, {right}/{len(texts)} right"
    return ", ".join(repr(t) for t in texts) + f"  {right}/{len(texts)} right"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-kvx demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=DEMO_MODELS, help="embedded demo checkpoint (default %(default)s)")
    parser.add_argument("--policy", default="gatesight", help="policy of the compacted arm (default %(default)s)")
    parser.add_argument("--keep-fraction", default="0.1", help="fraction p of a document's KV entries kept (default %(default)s)")
    parser.add_argument("--sessions", type=int, default=4, help="independent documents, one fact each (default %(default)s)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent client threads; each asks every session (default %(default)s)")
    parser.add_argument("--length", type=int, default=2048, help="tokens of a document + its question (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="greedy answer tokens (default %(default)s)")
    parser.add_argument("--pool", type=int, default=16384, help="the server's --max-total-tokens, in KV slots (default %(default)s)")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    ensure_demo_models()
    sessions = build_sessions(args.sessions, args.length)
    compacted = f"{args.policy} p={args.keep_fraction}"
    print(f"[sglang-kvx demo] {args.sessions} sessions (documents of ~{args.length} tokens, one fact each), "
          f"{args.clients} concurrent clients; starting SGLang on {args.model} with --kvx-policy {args.policy} "
          f"--kvx-keep-fraction {args.keep_fraction} --max-total-tokens {args.pool} ...", flush=True)
    server = ServerProcess(weights_root() / args.model, "--kvx-policy", args.policy, "--kvx-keep-fraction",
                           str(args.keep_fraction), max_total_tokens=args.pool)
    with server:
        print(f"[sglang-kvx demo] server ready in {server.startup_seconds:.1f} s at {server.url} (log: {server.log_path})", flush=True)
        arms = {
            "full cache": run_arm(server, sessions, {"compact": False}, args.clients, args.max_new_tokens),
            compacted: run_arm(server, sessions, {}, args.clients, args.max_new_tokens),
        }
    full, comp = arms["full cache"], arms[compacted]

    print()
    for i, session in enumerate(sessions):
        print(f"{session['name']}: a {session['tokens']}-token essay, the fact at depth {session['depth']:.0f}%, "
              f"expected {session['expected']}")
        print(f"  Q: {session['question'].split('?')[0].strip()}?")
        print(f"  full cache     : {_shown(full['answers'][i])}")
        print(f"  {compacted:15}: {_shown(comp['answers'][i])}")

    def fit(slots: list[int]) -> int:
        return args.pool // max(1, round(statistics.mean(slots)))

    rows = [
        ("KV slots per session (measured)", f"{statistics.mean(full['slots']):.0f}", f"{statistics.mean(comp['slots']):.0f}"),
        (f"sessions in the {args.pool}-slot pool (computed)", str(fit(full["slots"])), str(fit(comp["slots"]))),
        ("mean question latency (measured)", f"{full['latency_s']:.3f} s", f"{comp['latency_s']:.3f} s"),
        ("mean commit: prefill (+ compaction)", f"{statistics.mean(full['commit_s']):.3f} s", f"{statistics.mean(comp['commit_s']):.3f} s"),
        ("answers right", f"{full['right']}/{full['asked']}", f"{comp['right']}/{comp['asked']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}}  {'full cache':>12}  {compacted:>16}")
    for label, a, b in rows:
        print(f"{label:{width}}  {a:>12}  {b:>16}")
    print(f"\n(computed: pool slots // KV slots per session; a compacted session also needs room for its "
          f"full prefill while it is being compacted. Latency: {args.clients} clients at once, "
          f"{full['asked']} questions per arm.)")
    print(f"[sglang-kvx demo] server stopped; {time.perf_counter() - t_start:.1f} s in all "
          f"({server.startup_seconds:.1f} s of it starting the server).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
