"""Load on a real server with stored contexts in tiers below the pool (issue #53 item 7), shared by
``tests/test_tier_soak.py`` and the router test of ``tests/test_context_dir_e2e.py``.

``run_load`` keeps N clients busy for a bounded time, each mixing, at random from its own seed:
children of known documents (their contexts stored in the pool, host memory or on disk), long
plain requests that push stored contexts out of the pool, streams closed after a few chunks, and
``max_new_tokens: null`` requests. Every request is recorded; ``Verdict`` then checks each answer
against its reference, after the load (the HF oracle does not compete with the server for the
machine's cores while it runs):

- a child (``meta_info.kvx``: ``child: true``) answers as the same (document, question) first
  answered from the pool (``Book.pool``, recorded by the caller, greedy: a shorter answer is a
  prefix of a longer one);
- a child served by a full prefill (``child: false`` with a reason) answers as the plain model (the
  HF reference);
- a plain request answers as the plain model;
- a stream closed early: the tokens it got are a prefix of its reference.

Greedy decoding throughout (temperature 0, ``ignore_eos``).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import requests

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def ids(n: int, seed: int) -> list[int]:
    """``n`` random token ids (no special tokens; the demo models' vocabulary is 512)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def outcome(body: dict) -> dict:
    """A response's ``meta_info.kvx`` last entry ({} when it has none)."""
    return (body.get("meta_info", {}).get("kvx") or [{}])[-1]


def loads(url: str) -> dict:
    """SGLang's own ``/v1/loads`` (rank 0): running and waiting requests, as the scheduler sees them."""
    response = requests.get(url + "/v1/loads", timeout=30)
    response.raise_for_status()
    return response.json()["loads"][0]


def poll(condition, timeout: float, what: str, interval: float = 0.02):
    """``condition()`` until it returns something truthy (returned); AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def balance_problem(server, timeout: float = 60.0, hold: float = 1.0) -> str | None:
    """Once nothing runs or waits: every pool slot is free, evictable (SGLang's radix cache) or held by
    the stored contexts, and still so ``hold`` seconds on (SGLang checks its pool for leaks when its
    scheduler goes idle, and ends it on one) -- None; else what is off, after ``timeout``."""
    deadline = time.monotonic() + timeout
    since = None
    while True:
        try:
            load = loads(server.url)
            stats = server.stats()
        except requests.RequestException as exc:
            return f"the server stopped answering ({type(exc).__name__})"
        held = stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"] + stats["store_slots"]
        idle = load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        if idle and held == stats["kv_pool_total_tokens"]:
            since = since or time.monotonic()
            if time.monotonic() - since >= hold:
                return None
        else:
            since = None
        if time.monotonic() > deadline:
            return (f"pool not balanced when idle: {stats['kv_pool_free_tokens']} free + {stats['kv_pool_evictable_tokens']} "
                    f"evictable + {stats['store_slots']} stored != {stats['kv_pool_total_tokens']} slots "
                    f"(running {load['num_running_reqs']}, waiting {load['num_waiting_reqs']})")
        time.sleep(0.1)


def crash_excerpt(server, lines: int = 36) -> str:
    """What a failed test shows of a dead server's log: the extension's last error lines, then the
    last traceback with the lines just before it (or the log's tail)."""
    log = server.log_path.read_text(errors="replace").splitlines() if server.log_path.exists() else []
    ours = [line for line in log if "sglang_kvx:" in line and ("error" in line or "failed" in line)][-4:]
    starts = [i for i, line in enumerate(log) if "Traceback" in line]
    shown = log[max(0, starts[-1] - 4):] if starts else log[-lines:]
    shown = shown if len(shown) <= lines else [*shown[:6], "...", *shown[-(lines - 7):]]
    return "\n".join([*ours, *(["..."] if ours else []), *shown])


@dataclass
class Book:
    """The references: ``pool[(d, q)]``, the first answer (document d, question q) got from the pool;
    the plain model (HF) for the rest."""

    ref: object  # sglang_kvx.reference.hf.HFReference
    docs: list[list[int]]
    questions: list[list[int]]
    pool: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def plain_greedy(self, prompt: list[int], tokens: list[int]) -> list[int]:
        return plain_greedy(self.ref, prompt, tokens)


def plain_greedy(ref, prompt: list[int], tokens: list[int]) -> list[int]:
    """The plain model's (HF) greedy answer as long as ``tokens``, checked in one forward pass over
    ``prompt + tokens`` (teacher forcing: each greedy token is the argmax after the ones before, so
    ``tokens`` is the greedy answer when it is that argmax at every step): ``tokens`` itself when it
    is, else its agreeing beginning and the greedy token where it first differs."""
    import torch

    if not tokens:
        return []
    with torch.no_grad():
        argmax = ref.logits(prompt + tokens[:-1])[len(prompt) - 1:].argmax(dim=-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(tokens, argmax)) if a != b), None)
    return list(tokens) if first is None else [*tokens[:first], argmax[first]]


@dataclass
class Record:
    kind: str  # child | plain | stream | null
    prompt: list[int]
    max_new_tokens: int | None
    doc: tuple[int, int] | None = None  # (d, q) of a child
    status: int | None = None
    body: dict | None = None
    error: str | None = None
    tokens: list[int] = field(default_factory=list)  # what came back (a closed stream: what it got)
    said: dict = field(default_factory=dict)  # meta_info.kvx's last entry
    meta: dict = field(default_factory=dict)  # meta_info (a stream: its last chunk's)
    seconds: float = 0.0


@dataclass
class Mix:
    """What a client sends, by weight; the long plain requests' lengths; null requests' prompts leave
    ``null_room`` (a range) of the context length to generate into."""

    child: float = 0.6
    plain: float = 0.12
    stream: float = 0.14
    null: float = 0.14
    plain_tokens: tuple[int, int] = (1500, 2900)
    null_room: tuple[int, int] = (16, 48)
    answer: int = 8  # at most this many tokens per child (the pool's references' length)
    settings: dict | None = None  # the children's custom_params.kvx, sent on half of them


def _send(session: requests.Session, url: str, record: Record, mix: Mix, rng: random.Random, timeout: float) -> None:
    sampling = {**GREEDY, "max_new_tokens": record.max_new_tokens}
    if record.kind in ("child", "stream") and mix.settings and rng.random() < 0.5:
        sampling["custom_params"] = {"kvx": mix.settings}
    payload = {"input_ids": record.prompt, "sampling_params": sampling}
    start = time.monotonic()
    try:
        if record.kind == "stream":
            # Closed after a few chunks: the server must abort it and give its slots back.
            chunks = rng.randint(1, 3)
            with session.post(url + "/generate", json={**payload, "stream": True}, stream=True, timeout=timeout) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.error = response.text[:500]
                    return
                for line in response.iter_lines():
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        record.error = json.dumps(chunk)[:500]
                        return
                    record.tokens = chunk.get("output_ids", [])  # cumulative
                    record.meta = chunk.get("meta_info", {})
                    chunks -= 1
                    if chunks == 0:
                        break
            return
        response = session.post(url + "/generate", json=payload, timeout=timeout)
        record.status = response.status_code
        if response.status_code != 200:
            record.error = response.text[:500]
            return
        record.body = response.json()
        record.tokens = record.body["output_ids"]
        record.meta = record.body["meta_info"]
        record.said = outcome(record.body)
    except requests.RequestException as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        record.seconds = time.monotonic() - start


def run_load(url: str, book: Book, seconds: float, seed: int, mix: Mix, context_length: int, clients: int = 8,
             alive=lambda: True, timeout: float = 120.0) -> list[Record]:
    """``clients`` threads sending ``mix`` to ``url`` for ``seconds`` (requests already sent finish);
    stops early once ``alive()`` is false (a dead server answers nothing more). A request taking over
    ``timeout`` seconds is recorded as failed (a hang)."""
    records: list[Record] = []
    lock = threading.Lock()
    stop = threading.Event()
    end = time.monotonic() + seconds
    weights = [mix.child, mix.plain, mix.stream, mix.null]

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        with requests.Session() as session:
            n = 0
            while time.monotonic() < end and not stop.is_set():
                n += 1
                kind = rng.choices(("child", "plain", "stream", "null"), weights)[0]
                if kind in ("child", "stream"):
                    d, q = rng.randrange(len(book.docs)), rng.randrange(len(book.questions))
                    prompt = book.docs[d] + book.questions[q]
                    record = Record(kind, prompt, rng.randint(1, mix.answer) if kind == "child" else 64, doc=(d, q))
                elif kind == "plain":
                    record = Record(kind, ids(rng.randint(*mix.plain_tokens), seed=seed * 10**6 + c * 10**4 + n), rng.randint(1, 3))
                else:
                    record = Record(kind, ids(context_length - rng.randint(*mix.null_room), seed=seed * 10**6 + c * 10**4 + n), None)
                _send(session, url, record, mix, rng, timeout)
                with lock:
                    records.append(record)
                if record.error and not alive():
                    stop.set()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 2 * timeout)
    return records


def stream_child_source(record: Record) -> str | None:
    """Where a streamed request's compacted context came from ("pool", "host", "disk"; None: it read
    none). A closed stream has no ``meta_info.kvx``; every chunk of a child names its context's source
    in ``cached_tokens_details`` (``kvx_pool``, ``kvx_host``, ``kvx_disk``); before that field, a
    child's ``prompt_tokens`` counted its compacted prefix instead of the context."""
    details = record.meta.get("cached_tokens_details") or {}
    sources = [key[len("kvx_"):] for key, count in details.items() if key.startswith("kvx_") and count]
    if sources:
        return sources[0]
    return "pool" if record.meta.get("prompt_tokens", len(record.prompt)) < len(record.prompt) else None


@dataclass
class Verdict:
    """Every record checked against its reference: ``wrong`` and ``failed`` (non-200, errors) describe
    what went wrong; the counts say what was served how."""

    checked: int = 0
    wrong: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    served: Counter = field(default_factory=Counter)  # child, child_restored_host/disk, full_prefill, plain, ...
    reasons: Counter = field(default_factory=Counter)  # why children were served by a full prefill
    streamed_tokens: int = 0
    unchecked_tokens: int = 0  # streamed tokens past the end of a pool reference (rare: the chunks read are few)

    @classmethod
    def of(cls, records: list[Record], book: Book, mix: Mix) -> "Verdict":
        verdict = cls()
        for record in records:
            verdict._check(record, book, mix)
        return verdict

    def _check(self, record: Record, book: Book, mix: Mix) -> None:
        where = f"{record.kind} ({len(record.prompt)} tokens, max_new_tokens {record.max_new_tokens}, doc {record.doc})"
        if record.error is not None or record.status != 200:
            self.failed.append(f"{where}: HTTP {record.status}: {record.error}")
            return
        tokens, said = record.tokens, record.said
        if record.kind in ("child", "plain") and len(tokens) != record.max_new_tokens:
            self.wrong.append(f"{where}: {len(tokens)} tokens for max_new_tokens {record.max_new_tokens}")
            return
        if record.kind == "null" and (record.meta["finish_reason"]["type"] != "length" or not tokens):
            self.wrong.append(f"{where}: finish {record.meta['finish_reason']} after {len(tokens)} tokens")
            return
        if record.kind == "child" and said.get("child") is True:
            served, reference = f"child_from_{said.get('restored_from', 'pool')}", book.pool[record.doc]
        elif record.kind == "child" and said.get("child") is False and said.get("reason"):
            served, reference = "full_prefill", book.plain_greedy(record.prompt, tokens)
            self.reasons[said["reason"][:100]] += 1
        elif record.kind == "child":
            self.wrong.append(f"{where}: a child of a stored context served without saying how: kvx {said}")
            return
        elif record.kind == "stream" and (source := stream_child_source(record)):
            served, reference = f"stream_child_from_{source}", book.pool[record.doc]
        elif record.kind == "stream":
            served, reference = "stream_full_prefill", book.plain_greedy(record.prompt, tokens)
        else:
            served, reference = record.kind, book.plain_greedy(record.prompt, tokens)
        self.served[served] += 1
        self.checked += 1
        if record.kind == "stream":
            self.streamed_tokens += len(tokens)
            self.unchecked_tokens += max(0, len(tokens) - len(reference))  # past the pool's reference
        n = min(len(tokens), len(reference))
        if tokens[:n] != reference[:n]:
            first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
            self.wrong.append(f"{where} served as {served} (kvx {said}): tokens {tokens} != reference {reference[:n]} "
                              f"(first difference at {first})")

    def problems(self, limit: int = 12) -> list[str]:
        return [*self.failed[:limit], *self.wrong[:limit]]
