"""No request changes another's settings (issue #41 item 3).

A mixed sequence of per-request overrides -- parents and children under policies other than the
server's, other keep fractions, a tenant, a decode step, plain requests, bad fields -- is sent to a
shared server one after another without a flush; then each item is sent again on its own, after
``/flush_cache`` (the server back at its start state, as a fresh one: the suite's fixture checks
that state after every test). Each item reads its own document, so the only way the two runs can
differ is state one request leaves behind for another: every answer (status, tokens, and what the
extension says it did in ``meta_info.kvx``) must be the same. Run on the compacting server and on the
block-sparse one, which has no policy of its own (there one client's policy once became every later
request's, until a flush).
"""

from __future__ import annotations

import pytest

from test_compaction_e2e import GREEDY, text

KVX_KEYS = ("child", "compacted", "reason", "policy", "keep_fraction", "slots", "context_tokens", "already_stored")


def _kvx(**fields) -> dict:
    return {"custom_params": {"kvx": fields}}


def _items(ref) -> list[tuple[str, list[dict]]]:
    """(name, requests): the last request of each is the one compared; earlier ones set it up."""
    docs = [ref.encode(text(90, seed=700 + i)) for i in range(8)]
    question = ref.encode(" which word comes next?")

    def parent(doc, **fields):
        return {"input_ids": doc, "sampling_params": {"max_new_tokens": 0, **(_kvx(**fields) if fields else {})}}

    def ask(doc, new=5, **fields):
        return {"input_ids": doc + question, "sampling_params": {**GREEDY, "max_new_tokens": new,
                                                                 **(_kvx(**fields) if fields else {})}}

    return [
        ("snapkv parent and child", [parent(docs[0], policy="snapkv", keep_fraction=0.3),
                                     ask(docs[0], policy="snapkv", keep_fraction=0.3)]),
        ("plain request", [ask(docs[1])]),
        ("knorm child of a tenant", [parent(docs[2], policy="knorm", keep_fraction=0.5, tenant="t1"),
                                     ask(docs[2], policy="knorm", keep_fraction=0.5, tenant="t1")]),
        ("server default parent and child", [parent(docs[3]), ask(docs[3])]),
        ("bad field", [ask(docs[4], keep_fraction=7)]),
        ("decode step", [ask(docs[5], 8, decode={"step": "streamingllm", "sinks": 4, "window": 32})]),
        ("keydiff at 0.2", [parent(docs[6], policy="keydiff", keep_fraction=0.2),
                            ask(docs[6], policy="keydiff", keep_fraction=0.2)]),
        ("plain parent-shaped request", [parent(docs[7]), ask(docs[7])]),
    ]


def _answer(server, request: dict) -> tuple:
    response = server.generate(request)
    if response.status_code != 200:
        return response.status_code, response.text[:200]
    body = response.json()
    outcome = [{key: entry[key] for key in KVX_KEYS if key in entry} for entry in body["meta_info"].get("kvx", [])]
    return 200, body["output_ids"], outcome


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["compacting", "sparse"])
def test_answers_in_a_mixed_sequence_equal_each_request_sent_alone(kind, shared_server, references) -> None:
    server, ref = shared_server(kind, "tiny-llama"), references["tiny-llama"]
    items = _items(ref)
    in_sequence = {}
    for name, requests_ in items:
        for request in requests_:
            answer = _answer(server, request)
        in_sequence[name] = answer
    served = [name for name, answer in in_sequence.items() if answer[0] == 200]
    assert len(served) >= 4, in_sequence  # the sequence serves most items on either server
    for name, requests_ in items:
        server.flush()
        for request in requests_:
            alone = _answer(server, request)
        assert in_sequence[name] == alone, f"{name!r} on the {kind} server: in the sequence {in_sequence[name]}, alone {alone}"


def _stream_with_aborts(url: str, payload: dict, aborts: list[str]) -> dict:
    """Stream ``payload``; once its first tokens arrived (it is running), post each abort; the last chunk."""
    import json

    import requests

    last = None
    with requests.post(url + "/generate", json={**payload, "stream": True}, stream=True, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if last is None:
                for rid in aborts:
                    requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
            last = json.loads(line[len(b"data: "):])
    return last


@pytest.mark.slow
def test_one_clients_abort_never_reaches_another_clients_request(shared_server, references) -> None:
    """SGLang's scheduler matches an abort's rid as a prefix; a client's abort of a rid it does not
    hold ("v", "victim-", ...) must not end another client's running request ("victim-..."): it is
    answered in full, with the tokens it gets when nobody aborts anything. The exact rid does abort
    it (the aborts reach a running request)."""
    import uuid

    server, ref = shared_server("compacting", "tiny-llama"), references["tiny-llama"]
    payload = {"input_ids": ref.encode(text(60, seed=720)), "sampling_params": {**GREEDY, "max_new_tokens": 300}}
    expected = server.generate(payload).json()["output_ids"]
    rid = f"victim-{uuid.uuid4().hex}"
    last = _stream_with_aborts(server.url, {**payload, "rid": rid}, ["v", "victim", "victim-", rid[:-1]])
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["output_ids"] == expected, last["meta_info"]
    rid = f"victim-{uuid.uuid4().hex}"
    last = _stream_with_aborts(server.url, {**payload, "rid": rid}, [rid])
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 300, last["meta_info"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["child", "decode step"])
def test_a_stream_dropped_by_its_client_leaves_nothing_behind(case, shared_server, references) -> None:
    """A client that disconnects mid-stream, from a child of a compacted context or from a request
    running a decode step (StreamingLLM): SGLang aborts the request, the context is released (no
    child left on it), the decode row ends, the pool balances, and the same request sent again is
    answered as before the disconnect."""
    import time

    import requests

    from test_compaction_e2e import compact, wait_idle

    server, ref = shared_server("compacting", "tiny-llama"), references["tiny-llama"]
    context, question = ref.encode(text(150, seed=730)), ref.encode(" which word comes next?")
    compact(server, context, "keydiff", 0.3)
    fields = ({"policy": "keydiff", "keep_fraction": 0.3} if case == "child"
              else {"compact": False, "decode": {"step": "streamingllm", "sinks": 4, "window": 32}})
    payload = {"input_ids": context + question, "stream": True,
               "sampling_params": {**GREEDY, "max_new_tokens": 400, **_kvx(**fields)}}
    expected = requests.post(server.url + "/generate", json={**payload, "stream": False}, timeout=120).json()
    assert len(expected["output_ids"]) == 400, expected
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                break  # the first tokens arrived: drop the connection
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (server.stats()["decode_rows"]
                                           or any(c["active_children"] for c in server.stats()["compacted_contexts"])):
        time.sleep(0.2)
    stats = wait_idle(server, server.stats()["kv_pool_total_tokens"])
    assert stats["decode_rows"] == 0 and not any(c["active_children"] for c in stats["compacted_contexts"]), stats
    again = requests.post(server.url + "/generate", json={**payload, "stream": False}, timeout=120).json()
    assert again["output_ids"] == expected["output_ids"]
    assert (again["meta_info"].get("kvx") or [{}])[0].get("child", False) is (case == "child"), again["meta_info"]
