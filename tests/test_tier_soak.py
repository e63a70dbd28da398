"""Issue #53 item 7: the tiers below the pool under load, on the real server (the shared ``soak``
server of ``tests/server_pool.py``: a 3,072-slot pool that one long request empties, KeyDiff at
p = 0.25, host memory for about four of these contexts, the disk below it, every context written
when stored).

- The deterministic case of item 1: a child whose context must come back from host memory is
  queued behind a plain request that SGLang budgets the room for once a running request ends; the
  restore must not take that room from under it (it killed the scheduler: ``Out of memory`` in
  ``prepare_for_extend``).
- Found under SGLang's bench_serving and bench_disk_write_stall: a request SGLang's budget turns
  away (one slot short; the running requests' reserved growth) gets the room idle contexts hold, as
  it would get the prefix cache's on plain SGLang (it waited for good, or until the long one ended).
- Found by the soak: a child queued behind a running request must not hold, restored in the pool,
  the room that request's decode needs (it was aborted with 500); children of a context read from
  disk together restore it once (a second restore was a 500 and leaked its slots).
- The soak: 14 documents (16 in the long one) compacted and asked by 8 concurrent clients
  for a bounded time, their contexts cycling pool -> host -> disk and back, mixed with long plain
  requests that push them out, streams closed after a few chunks and ``max_new_tokens: null``
  requests. Every answer equals its reference (``tests/tier_load.py``): a child's the first answer
  its (document, question) got from the pool -- itself checked against the HF oracle with the
  served keep-set --, a full prefill's and a plain request's the plain model's; the server stays up
  (every request 200), the pool balances when idle, and the check after the test flushes it whole.
  The figures (requests, answers checked, restores per tier, waits, duration) end in one line.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import requests

from server_pool import SOAK_DIR, SOAK_POOL
from test_compaction_e2e import served_keep_set
from tier_load import (GREEDY, Book, Mix, Verdict, balance_problem, crash_excerpt, ids, loads, outcome, plain_greedy,
                       poll, run_load)

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
POLICY, P = "keydiff", 0.25  # the soak server's own settings (a child may name them or not)
QUESTIONS = 2
ANSWER = 8  # tokens of each pool reference; a child asks 1 to 8
SOAK_SECONDS, SOAK_DOCS = 20, 14  # in the suite
CLIENT_TIMEOUT = 60  # seconds: a soak request that takes longer is a hang (they take well under 10 s here)
LONG_SECONDS, LONG_DOCS = 300, 16  # scripts/test.sh --long


@pytest.fixture
def soak_server(shared_specs, server_pool, references):
    """(server, reference, forget): the shared soak server; ``forget()`` drops it from the pool when a
    test fails on its death or its leak (``finish``)."""
    server_spec = shared_specs("soak", MODEL)
    server = server_pool.get(server_spec)
    return server, references[MODEL], lambda: server_pool.forget(server_spec)


def finish(server, forget, what: str, problems: list[str]) -> None:
    """A test's end: the server idle, alive and its pool balanced (``balance_problem``), and none of
    ``problems``; else the test fails with all of them and the server's log. A server found dead or
    leaking is dropped from the pool first: the next test gets a fresh one, and the check after this
    test does not report it again."""
    balance = balance_problem(server)
    deadline = time.monotonic() + (30 if balance and "stopped answering" in balance else 0)
    while server.proc.poll() is None and time.monotonic() < deadline:  # SGLang takes seconds to go down
        time.sleep(0.2)
    if server.proc.poll() is not None:
        problems.append(f"the server died (exit code {server.proc.returncode}) {what}")
    elif balance:
        problems.append(f"{balance} ({what})")
    if server.proc.poll() is not None or balance:
        problems.append(f"the server's log:\n{crash_excerpt(server)}")
        forget()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def answer_problems(out: dict, expected: dict) -> list[str]:
    """What is wrong with the answers in ``out`` (name: (status, body)): each must be 200 and its tokens
    ``expected[name](body)`` (a reference computed from how it says it was served)."""
    problems = [f"{name}: HTTP {out[name][0] if name in out else 'no answer'}: {out[name][1] if name in out else ''}"
                for name in expected if name not in out or out[name][0] != 200]
    for name, reference in expected.items():
        if name in out and out[name][0] == 200:
            body = out[name][1]
            want = reference(body)
            if isinstance(want, str):
                problems.append(f"{name}: {want}")
            elif body["output_ids"] != want:
                problems.append(f"{name}: tokens {body['output_ids']} != its reference {want} (kvx {outcome(body)})")
    return problems


def child_reference(ref, context: list[int], keep, question: list[int], n: int):
    """A child's reference from how it says it was served: read the compacted context -- the HF oracle
    with the served keep-set; a full prefill with its reason -- the plain model."""
    def reference(body):
        said = outcome(body)
        if said.get("child"):
            return ref.compacted_generate(context, keep, question, n)[0]
        if said.get("reason"):
            return ref.greedy(context + question, n)
        return f"served without saying how (kvx {said})"
    return reference


def post(server, prompt: list[int], max_new_tokens: int | None, out: dict, name: str, **sampling) -> threading.Thread:
    """``prompt`` sent on a thread of its own; ``out[name]``: (status, body or error text)."""
    def send():
        try:
            response = server.generate({"input_ids": prompt, "sampling_params": {
                **GREEDY, "max_new_tokens": max_new_tokens, **sampling}}, timeout=180)
            out[name] = (response.status_code, response.json() if response.status_code == 200 else response.text[:500])
        except Exception as exc:  # noqa: BLE001 -- a dead server's answer is the failure to report
            out[name] = (None, f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_restore_queued_behind_a_budgeted_prefill_leaves_it_its_room(soak_server):
    """#53 item 1's deterministic case. A compacted context C (800 tokens -> 200 slots) pushed to host
    memory by a 2,900-token plain request; a running plain request R (1,500 tokens, 150 generated)
    holds the room the next plain request X (2,900 tokens, 1 generated) needs; C's child is queued
    behind X. When R ends, SGLang budgets the prefill batch with X; the child's restore must not take
    200 of those slots (the scheduler died: ``Out of memory`` in ``prepare_for_extend``). Every request
    is answered, each as its reference says; the pool balances."""
    server, ref, forget = soak_server
    server.flush()
    context, question = ids(800, seed=5301), ids(20, seed=5302)
    parent = server.generate({"input_ids": context, "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
    assert outcome(parent).get("compacted") is True, parent["meta_info"]
    keep = served_keep_set(server, len(context), POLICY, P)
    pushed = server.generate({"input_ids": ids(2900, seed=5303), "sampling_params": {**GREEDY, "max_new_tokens": 1}})
    assert pushed.status_code == 200, pushed.text
    stats = server.stats()
    assert stats["host_contexts"] == 1 and stats["compacted_contexts"] == [], stats["compacted_contexts"]

    running, big = ids(1500, seed=5304), ids(2900, seed=5305)
    out: dict = {}
    threads = [post(server, running, 150, out, "R")]
    poll(lambda: loads(server.url)["num_running_reqs"] == 1, 60, "R running")
    threads.append(post(server, big, 1, out, "X"))
    poll(lambda: loads(server.url)["num_waiting_reqs"] == 1, 60, "X queued behind R")
    threads.append(post(server, context + question, 4, out, "child"))
    # The scenario holds only if the child joined the queue while R still ran.
    state = poll(lambda: (lambda load: load if load["num_waiting_reqs"] >= 2 or "R" in out else None)(loads(server.url)),
                 60, "the child queued")
    assert "R" not in out and state["num_running_reqs"] == 1, (
        f"the scenario was not set up: R ended before the child queued behind X (this machine was too slow?) {state}")
    for thread in threads:
        thread.join(200)

    finish(server, forget, "serving R, X and the child", answer_problems(out, {
        "R": lambda body: ref.greedy(running, 150),
        "X": lambda body: ref.greedy(big, 1),
        "child": child_reference(ref, context, keep, question, 4)}))


def test_a_queued_child_holds_no_room_a_running_request_needs(soak_server):
    """Found by the soak: a plain request R (2,500 tokens, ``max_new_tokens: null``, so up to the
    context length, which is the pool) is decoding when a child of a context in host memory arrives.
    SGLang queues the child (R's growth holds the room); the context must not sit restored in the
    pool, held for the queued child, where R's decode needs it: R was aborted with 500 ("Out of
    memory even after retracting all other requests in the decode batch"). On plain SGLang R alone
    always fits. Both are answered, each as its reference says; the pool balances."""
    server, ref, forget = soak_server
    server.flush()
    context, question, running = ids(800, seed=5311), ids(20, seed=5312), ids(2500, seed=5313)
    parent = server.generate({"input_ids": context, "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
    assert outcome(parent).get("compacted") is True, parent["meta_info"]
    keep = served_keep_set(server, len(context), POLICY, P)
    pushed = server.generate({"input_ids": ids(2900, seed=5314), "sampling_params": {**GREEDY, "max_new_tokens": 1}})
    assert pushed.status_code == 200 and server.stats()["host_contexts"] == 1, pushed.text

    out: dict = {}
    threads = [post(server, running, None, out, "R")]
    poll(lambda: loads(server.url)["num_running_reqs"] == 1 or "R" in out, 60, "R running")
    assert "R" not in out, f"R ended before the child was sent: {out['R']}"
    threads.append(post(server, context + question, 8, out, "child"))
    for thread in threads:
        thread.join(200)

    def null_reference(body):  # up to the context length, as the plain model goes on
        if body["meta_info"]["finish_reason"]["type"] != "length" or not body["output_ids"]:
            return f"finished {body['meta_info']['finish_reason']} after {len(body['output_ids'])} tokens"
        return plain_greedy(ref, running, body["output_ids"])

    finish(server, forget, "serving R and the child", answer_problems(out, {
        "R": null_reference, "child": child_reference(ref, context, keep, question, 8)}))


def test_a_request_one_slot_short_of_the_budget_gets_the_idle_contexts_room(soak_server):
    """Found under SGLang's bench_serving (disk tier, p = 0.5): nothing running, idle compacted
    contexts holding most of the pool, and a plain request whose prompt plus growth is exactly the
    free and evictable slots. SGLang admits only a total *below* its budget, the extension counted
    it as fitting and evicted nothing: the request stayed queued for good, the scheduler spinning.
    Here it is answered (as the plain model answers) and a context made way for it."""
    server, ref, forget = soak_server
    server.flush()
    for seed in (5321, 5322):
        parent = server.generate({"input_ids": ids(800, seed=seed), "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
        assert outcome(parent).get("compacted") is True, parent["meta_info"]
    stats = server.stats()
    assert len(stats["compacted_contexts"]) == 2, stats["compacted_contexts"]
    room, evicted = stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"], stats["contexts_evicted"]
    prompt = ids(room - 16 - 1, seed=5323)  # + 16 new tokens + SGLang's one slot of overhead: the budget, not below it
    out: dict = {}
    post(server, prompt, 16, out, "X").join(60)
    problems = answer_problems(out, {"X": lambda body: ref.greedy(prompt, 16)})
    if not problems and server.stats()["contexts_evicted"] <= evicted:
        problems.append("no idle context made way for the request")
    finish(server, forget, "serving a request one slot short of the budget", problems)


def test_a_request_the_running_growth_leaves_no_room_for_gets_the_idle_contexts_room(soak_server):
    """Found by bench_disk_write_stall: a plain request R decodes with a large ``max_new_tokens``;
    SGLang's budget holds R's remaining growth in reserve (all of it for ``ignore_eos``: 1,000 - k
    after k steps), so a new plain request X (1,500 tokens) that the free slots hold is turned away
    while idle contexts (3 x 275 slots) sit in the pool: 3,072 - 825 - 64 - 1,000 = 1,183 left. X waited until R finished (minutes
    there); on plain SGLang those slots would be evictable cache and X would run now. Here X is
    answered, as the plain model answers, while R still decodes, and contexts made way for it."""
    server, ref, forget = soak_server
    server.flush()
    for seed in (5331, 5332, 5333):  # 3 x 275 slots
        parent = server.generate({"input_ids": ids(1100, seed=seed), "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
        assert outcome(parent).get("compacted") is True, parent["meta_info"]
    evicted = server.stats()["contexts_evicted"]
    stop, chunks = threading.Event(), []

    def run_r():  # R streams until X is answered, then closes its stream (SGLang aborts it)
        body = {"input_ids": ids(64, seed=5334), "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 1000, "ignore_eos": True}}
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith(b"data:"):
                    chunks.append(line)
                if stop.is_set():
                    return

    runner = threading.Thread(target=run_r, daemon=True)
    runner.start()
    poll(lambda: len(chunks) >= 20, 60, "R decoding")
    prompt, out = ids(1500, seed=5335), {}
    sender = post(server, prompt, 1, out, "X")
    sender.join(120)
    r_decoding = runner.is_alive() and not any(b"[DONE]" in chunk for chunk in chunks)
    stop.set()
    runner.join(60)
    problems = answer_problems(out, {"X": lambda body: ref.greedy(prompt, 1)})
    if not r_decoding:
        problems.append(f"X was answered only after R ended ({len(chunks)} chunks)")
    if server.stats()["contexts_evicted"] <= evicted:
        problems.append("no idle context made way for X")
    poll(lambda: loads(server.url)["num_running_reqs"] == 0, 60, "R aborted")
    finish(server, forget, "serving X beside a long-running R", problems)


def test_children_of_a_context_read_from_disk_get_it_once(soak_server, tmp_path):
    """Found by the soak: a context held only on disk (here: its files put back after ``/flush_cache``
    emptied every tier, what a restarted server finds) and several children of it arriving together
    while a plain request decodes. Each child waited for the file's read; the first restored the
    context, and another, on its stale plan, restored it a second time: 500 ("context already
    compacted with these settings"), and the second copy's slots leaked, so SGLang's leak check ended
    the scheduler once idle. Every child is answered as the HF oracle answers with the served keep-set
    (or, served by a full prefill with its reason, as the plain model); the server stays up and the
    pool balances."""
    server, ref, forget = soak_server
    server.flush()
    context = ids(801, seed=5321)
    parent = server.generate({"input_ids": context, "sampling_params": {**GREEDY, "max_new_tokens": 0}}).json()
    assert outcome(parent).get("compacted") is True, parent["meta_info"]
    keep = served_keep_set(server, len(context), POLICY, P)
    poll(lambda: (lambda stats: stats["disk_contexts"] == 1 and not stats.get("disk_writes_queued"))(server.stats()),
         30, "its files written", interval=0.1)
    saved = tmp_path / "saved"
    shutil.copytree(SOAK_DIR, saved)
    server.flush()
    for file in saved.iterdir():
        shutil.copy2(file, SOAK_DIR / file.name)
    poll(lambda: (lambda stats: stats["disk_contexts"] == 1 and not stats["compacted_contexts"]
                  and not stats["host_compacted_contexts"])(server.stats()), 30, "the files found", interval=0.1)

    running = ids(600, seed=5323)
    out: dict = {}
    threads = [post(server, running, 300, out, "R")]
    poll(lambda: loads(server.url)["num_running_reqs"] == 1 or "R" in out, 60, "R running")
    questions = [ids(20, seed=5340 + i) for i in range(4)]
    threads += [post(server, context + question, 8, out, f"child{i}") for i, question in enumerate(questions)]
    for thread in threads:
        thread.join(200)

    finish(server, forget, "serving R and four children of a context on disk", answer_problems(out, {
        "R": lambda body: plain_greedy(ref, running, body["output_ids"]),
        **{f"child{i}": child_reference(ref, context, keep, question, 8) for i, question in enumerate(questions)}}))


def record_pool_answers(server, book: Book) -> dict[int, list]:
    """Each document compacted, then asked each question from the pool (the references); the served
    keep-set of each, read while it is in the pool."""
    keeps = {}
    for d, doc in enumerate(book.docs):
        parent = server.generate({"input_ids": doc, "sampling_params": {**GREEDY, "max_new_tokens": 0}})
        assert parent.status_code == 200 and outcome(parent.json()).get("compacted") is True, parent.text
        keeps[d] = served_keep_set(server, len(doc), POLICY, P)
        for q, question in enumerate(book.questions):
            child = server.generate({"input_ids": doc + question, "sampling_params": {**GREEDY, "max_new_tokens": ANSWER}})
            assert child.status_code == 200, child.text
            said = outcome(child.json())
            assert said.get("child") is True and "restored_from" not in said, (d, q, said)
            book.pool[(d, q)] = child.json()["output_ids"]
    return keeps


def soak(server, ref, forget, seconds: float, n_docs: int, seed: int, report) -> None:
    server.flush()
    started = time.monotonic()
    before = server.stats()
    # Distinct lengths (the keep-sets are looked up by length): 700 to ~1,000 tokens, 175 to ~250 slots.
    docs = [ids(700 + 23 * d, seed=seed + d) for d in range(n_docs)]
    questions = [ids(12 + q, seed=seed + 100 + q) for q in range(QUESTIONS)]
    book = Book(ref, docs, questions)
    keeps = record_pool_answers(server, book)
    mix = Mix(answer=ANSWER, settings={"policy": POLICY, "keep_fraction": P})
    load_started = time.monotonic()
    records = run_load(server.url, book, seconds, seed, mix, SOAK_POOL, clients=8, timeout=CLIENT_TIMEOUT,
                       alive=lambda: server.proc.poll() is None)
    load_seconds = time.monotonic() - load_started
    try:
        after = server.stats()
    except requests.RequestException:
        after = None  # dead: finish says so, with the log

    verdict = Verdict.of(records, book, mix)
    # The references themselves: each document's first question against the HF oracle with the
    # keep-set the server chose.
    for d in range(n_docs):
        expected, _ = ref.compacted_generate(docs[d], keeps[d], questions[0], ANSWER)
        if book.pool[(d, 0)] != expected:
            verdict.wrong.append(f"the pool's answer to document {d}, question 0: {book.pool[(d, 0)]} != the HF "
                                 f"oracle's {expected}")
    delta = {key: after[key] - before[key] for key in ("host_contexts_stored", "host_restores", "disk_restores",
                                                       "restore_waits", "restore_failures", "contexts_evicted")} if after else {}
    slowest = max((r.seconds for r in records), default=0.0)
    report(f"[kvx soak] {seconds:.0f} s x 8 clients, {n_docs} documents: {len(records)} requests, {verdict.checked} answers "
           f"checked ({', '.join(f'{k} {v}' for k, v in sorted(verdict.served.items()))}); host_restores "
           f"{delta.get('host_restores')}, disk_restores {delta.get('disk_restores')}, restore_waits "
           f"{delta.get('restore_waits')}, contexts evicted {delta.get('contexts_evicted')}; full prefills "
           f"{dict(verdict.reasons) or 0}; slowest request {slowest:.1f} s; load {load_seconds:.1f} s, "
           f"test {time.monotonic() - started:.1f} s")

    problems = []
    if verdict.failed or verdict.wrong:
        problems.append(f"{len(verdict.failed)} requests failed, {len(verdict.wrong)} wrong answers of {len(records)}:\n"
                        + "\n".join(verdict.problems()))
    if verdict.checked + len(verdict.failed) + len(verdict.wrong) < len(records):
        problems.append(f"only {verdict.checked} of {len(records)} answers checked")
    # The soak did what it is for: contexts went down to host memory and to the disk and came back.
    if after and not (delta["host_contexts_stored"] > 0 and delta["host_restores"] > 0 and delta["disk_restores"] > 0):
        problems.append(f"the contexts did not cycle through every tier: {delta}")
    if after and after["disk_files_refused"] != before["disk_files_refused"]:  # its own files, all good
        problems.append(f"files the server wrote were refused: {after['disk_tier']}")
    finish(server, forget, f"under the soak ({load_seconds:.1f} s of load)", problems)


@pytest.fixture
def report(capsys):
    def say(line: str) -> None:
        with capsys.disabled():
            print("\n" + line)
    return say


def test_tiers_under_concurrent_load_answer_right_and_stay_up(soak_server, report):
    server, ref, forget = soak_server
    soak(server, ref, forget, SOAK_SECONDS, SOAK_DOCS, seed=5400, report=report)


@pytest.mark.long
def test_tiers_under_concurrent_load_for_minutes(soak_server, report):
    server, ref, forget = soak_server
    soak(server, ref, forget, LONG_SECONDS, LONG_DOCS, seed=5500, report=report)
