"""Issue #55 items 1-2 on real servers: SGLang's own usage fields, cache metrics and isolation keys tell
the truth about compacted requests.

- A child's ``prompt_tokens`` / ``usage.prompt_tokens`` are its real prompt's length (n + q), its
  ``cached_tokens`` (and ``usage.prompt_tokens_details.cached_tokens``) the n context tokens it did not
  prefill -- not its S slots -- with the extension's source beside SGLang's in ``cached_tokens_details``
  (``kvx_pool``, ``kvx_host``, ``kvx_disk``), on ``/generate``, ``/v1/completions`` and
  ``/v1/chat/completions``, streamed and not; SGLang's ``sglang:prompt_tokens_total`` and
  ``sglang:cached_tokens_total{cache_source=...}`` count the same; every figure is checked against the
  prompt's known token count, for children of the pool (flat and per-head), of host memory and disk,
  and chunked.
- ``cache_salt`` and ``extra_key`` isolate compacted contexts as they isolate radix entries: a child
  of another salt, or none, never reads a salted context; the same prefix under two salts is two
  contexts; prompts of two salts never make one auto-context.
"""

from __future__ import annotations

import json

import pytest
import requests

from test_compaction_e2e import compact, disk_settled, generate, kvx, text

pytestmark = pytest.mark.slow


def kvx_outcome(body: dict) -> dict:
    return (body["meta_info"].get("kvx") or [{}])[-1]


def check_child_meta(meta: dict, n: int, q: int, source: str = "kvx_pool") -> None:
    """A child's meta_info: SGLang's counts are the real prompt's; the slots are in meta_info.kvx."""
    outcome = (meta.get("kvx") or [{}])[-1]
    assert outcome.get("child") is True, meta
    assert meta["prompt_tokens"] == n + q, (meta["prompt_tokens"], n, q)
    assert meta["cached_tokens"] == n, (meta["cached_tokens"], n)
    details = meta["cached_tokens_details"]
    assert details.get(source) == n and details.get("device", 0) == 0, details
    assert 0 < outcome["slots"] < n and outcome["context_tokens"] == n


def metric(server, name: str, **labels) -> float:
    total = 0.0
    for line in requests.get(server.url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head = line.split("}")[0]
        if all(f'{key}="{value}"' in head for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def dense(shared_server, references):
    """The shared compacting tiny-llama (KeyDiff p = 0.5 by default, --enable-metrics, --enable-cache-report)."""
    return shared_server("compacting", "tiny-llama"), references["tiny-llama"]


@pytest.mark.parametrize("allocation", ["flat", "global"])  # global: per-head budgets
def test_a_pool_childs_usage_on_generate_streamed_and_not_and_in_the_metrics(dense, allocation):
    server, ref = dense
    server.flush()
    context = ref.encode(text(260, seed=5500))
    question = ref.encode(" Question: which word comes next? Answer:")
    n, q = len(context), len(question)
    compact(server, context, "keydiff", 0.5, allocation=allocation)
    before = (metric(server, "sglang:prompt_tokens_total"), metric(server, "sglang:cached_tokens_total", cache_source="kvx_pool"),
              metric(server, "sglang:cached_tokens_total", cache_source="device"))
    body = generate(server, context + question, 4, sampling=kvx("keydiff", 0.5, allocation=allocation))
    check_child_meta(body["meta_info"], n, q)
    # Streamed: every chunk carries the real counts (SGLang sends them with each).
    chunks = []
    with requests.post(server.url + "/generate", json={"input_ids": context + question, "stream": True, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, **kvx("keydiff", 0.5, allocation=allocation)}}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks.append(json.loads(line[5:]))
    assert len(chunks) >= 2
    for chunk in chunks:
        assert chunk["meta_info"]["prompt_tokens"] == n + q and chunk["meta_info"]["cached_tokens"] == n
    check_child_meta(chunks[-1]["meta_info"], n, q)
    after = (metric(server, "sglang:prompt_tokens_total"), metric(server, "sglang:cached_tokens_total", cache_source="kvx_pool"),
             metric(server, "sglang:cached_tokens_total", cache_source="device"))
    assert after[0] - before[0] == 2 * (n + q) and after[1] - before[1] == 2 * n, (before, after)
    assert after[2] == before[2]  # SGLang's own radix cache served none of the children's context


def test_openai_usage_of_a_child_completions_and_chat_streamed_and_not(dense):
    server, ref = dense
    server.flush()
    document = text(240, seed=5600)
    question = " Question: what comes next? Answer:"
    n = len(ref.encode(document))
    q = len(ref.encode(document + question)) - n
    compact(server, ref.encode(document), "keydiff", 0.5)
    body = {"model": "default", "prompt": document + question, "max_tokens": 4, "temperature": 0}
    response = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == n + q and usage["prompt_tokens_details"]["cached_tokens"] == n, usage
    streamed = requests.post(server.url + "/v1/completions", json={**body, "stream": True,
                             "stream_options": {"include_usage": True}}, stream=True, timeout=120)
    usages = [json.loads(line[5:])["usage"] for line in streamed.iter_lines()
              if line.startswith(b"data:") and line != b"data: [DONE]" and json.loads(line[5:]).get("usage")]
    assert usages and usages[-1]["prompt_tokens"] == n + q and usages[-1]["prompt_tokens_details"]["cached_tokens"] == n

    # Chat: the templated prompt's beginning is the parent; the chat request is its child.
    messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
    templated = list(ref.chat_ids(messages))
    system_only = list(ref.tokenizer.apply_chat_template(messages[:1], tokenize=True, return_dict=False))
    shared = 0
    while shared < min(len(templated), len(system_only)) and templated[shared] == system_only[shared]:
        shared += 1
    parent = templated[:shared]
    assert len(document.split()) // 2 < len(parent) < len(templated)
    compact(server, parent, "keydiff", 0.5)
    chat = requests.post(server.url + "/v1/chat/completions", json={"model": "default", "messages": messages,
                         "max_tokens": 4, "temperature": 0}, timeout=120)
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] == len(templated) and usage["prompt_tokens_details"]["cached_tokens"] == len(parent), (
        usage, len(templated), len(parent))
    streamed = requests.post(server.url + "/v1/chat/completions", json={"model": "default", "messages": messages,
                             "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                             stream=True, timeout=120)
    usages = [json.loads(line[5:])["usage"] for line in streamed.iter_lines()
              if line.startswith(b"data:") and line != b"data: [DONE]" and json.loads(line[5:]).get("usage")]
    assert usages and usages[-1]["prompt_tokens"] == len(templated)


def test_children_restored_from_host_memory_and_disk_report_those_sources(shared_server, references, tmp_path):
    import shutil

    from server_pool import TIERED_DIR
    from test_host_tier_e2e import push_out_every_context

    server, ref = shared_server("tiered", "tiny-llama"), references["tiny-llama"]
    server.flush()
    context = ref.encode(text(300, seed=5700))
    question = ref.encode(" Question: which word comes next? Answer:")
    n, q = len(context), len(question)
    compact(server, context, "knorm", 0.5)
    disk_settled(server, disk_contexts=1)  # persisted when stored
    saved = tmp_path / "saved"
    shutil.copytree(TIERED_DIR, saved)
    push_out_every_context(server, ref, seed=5800)  # to host memory
    body = generate(server, context + question, 4, sampling=kvx("knorm", 0.5))
    assert kvx_outcome(body).get("restored_from") == "host", body["meta_info"]
    check_child_meta(body["meta_info"], n, q, "kvx_host")
    server.flush()  # every tier emptied; the files put back are what a restarted server finds
    for file in saved.iterdir():
        shutil.copy2(file, TIERED_DIR / file.name)
    disk_settled(server, disk_contexts=1)
    body = generate(server, context + question, 4, sampling=kvx("knorm", 0.5))
    assert kvx_outcome(body).get("restored_from") == "disk", body["meta_info"]
    check_child_meta(body["meta_info"], n, q, "kvx_disk")


def test_a_chunked_childs_usage(shared_server, references):
    """On the chunked-prefill hybrid (chunks of CHUNK tokens) a child whose question spans chunks."""
    from server_pool import CHUNK

    server, ref = shared_server("chunked", "tiny-hybrid-deep"), references["tiny-hybrid-deep"]
    server.flush()
    context = ref.encode(text(200, seed=6000))
    question = ref.encode(text(CHUNK // 2 + 40, seed=6001))[: CHUNK + 20]
    n, q = len(context), len(question)
    compact(server, context, "keydiff", 0.2)
    body = generate(server, context + question, 3, sampling=kvx("keydiff", 0.2))
    check_child_meta(body["meta_info"], n, q)


# --- cache_salt and extra_key -------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["cache_salt", "extra_key"])
def test_a_salted_context_is_read_by_children_of_its_own_salt_only(dense, field):
    server, ref = dense
    server.flush()
    document = text(240, seed=6100)
    context = ref.encode(document)
    question = ref.encode(" Question: which word comes next? Answer:")
    parent = generate(server, context, 0, **{field: "tenantA"}, sampling=kvx("keydiff", 0.5))
    assert kvx_outcome(parent).get("compacted") is True
    [entry] = server.stats()["compacted_contexts"]
    assert entry["salted"] is True and "tenantA" not in json.dumps(server.stats())  # the salt is never shown
    plain = ref.greedy(context + question, 5)
    for salt in ("tenantB", None):
        extra = {field: salt} if salt is not None else {}
        body = generate(server, context + question, 5, **extra, sampling=kvx("keydiff", 0.5))
        assert not kvx_outcome(body).get("child"), (salt, body["meta_info"])
        assert body["output_ids"] == plain and body["meta_info"]["cached_tokens"] == 0
    own = generate(server, context + question, 5, **{field: "tenantA"}, sampling=kvx("keydiff", 0.5))
    assert kvx_outcome(own).get("child") is True
    # The same prefix under another salt is a context of its own.
    generate(server, context, 0, **{field: "tenantB"}, sampling=kvx("keydiff", 0.5))
    assert len(server.stats()["compacted_contexts"]) == 2
    # ... and through the OpenAI route, the salt a top-level field there too.
    response = requests.post(server.url + "/v1/completions", json={
        "model": "default", "prompt": document + " Question:", "max_tokens": 2, "temperature": 0, field: "tenantC"},
        timeout=120)
    assert response.status_code == 200, response.text
    assert (response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0  # nothing of theirs


def test_prompts_of_two_salts_never_make_one_auto_context(shared_server, references):
    server, ref = shared_server("chunked", "tiny-hybrid-deep"), references["tiny-hybrid-deep"]
    server.flush()
    document = ref.encode(text(120, seed=6200))
    queued = server.stats()["auto_contexts_queued"]
    for i, salt in enumerate(("tenantA", "tenantB")):
        generate(server, document + ref.encode(f" question {i}?"), 2, cache_salt=salt)
    assert server.stats()["auto_contexts_queued"] == queued  # one prompt per salt: nothing repeated within one
    generate(server, document + ref.encode(" question 9?"), 2, cache_salt="tenantA")
    assert server.stats()["auto_contexts_queued"] == queued + 1  # tenantA's two prompts share the beginning
