"""Children from SGLang's frontend language (fork after a shared context) and from the OpenAI API."""

from __future__ import annotations

import pytest
import requests
import torch


pytestmark = pytest.mark.slow

CONTEXT = (
    "Read the document and remember it.\n"
    + " ".join(["The river is long and the garden is green."] * 20)
    + " The special magic number for forest is 48213. "
    + " ".join(["The market is small and the bridge is old."] * 20)
    + "\n"
)
QUESTIONS = [
    "Question: what is the special magic number for forest? Answer: The special magic number for forest is",
    "Question: which word comes after river? Answer:",
    "Question: what is small? Answer:",
]


@pytest.fixture
def server(compacting_hybrid):
    """The shared compacting hybrid: KeyDiff at p = 0.5 for requests that name no policy (the frontend's)."""
    return compacting_hybrid[0]


def child_answer(server, text: str, max_new_tokens: int = 8) -> str:
    response = server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["cached_tokens"] > 0
    return response.json()["text"]


def contexts(server) -> list[dict]:
    return server.stats()["compacted_contexts"]


def test_frontend_fork_compacts_the_shared_prefix_and_reuses_it(server):
    import sglang as sgl

    @sgl.function
    def ask_all(s, context, questions):
        s += context
        forks = s.fork(len(questions))  # commits the context: a prefill-only request, our parent
        for fork, question in zip(forks, questions):
            fork += question + sgl.gen("answer", max_tokens=8, temperature=0)
        s["answers"] = [fork["answer"] for fork in forks]

    server.flush()
    backend = sgl.RuntimeEndpoint(server.url)
    # SGLang's fork commits the shared prefix only if the context text is already applied when
    # fork() checks it; with the executor thread that check races, so run synchronously.
    state = ask_all.run(context=CONTEXT, questions=QUESTIONS, backend=backend, use_thread=False)
    answers = state["answers"]
    [entry] = contexts(server)
    assert entry["policy"] == "keydiff" and entry["reuse_count"] == len(QUESTIONS)
    # Each fork's answer is what a plain child request on the same compacted context gets.
    for question, answer in zip(QUESTIONS, answers):
        assert child_answer(server, CONTEXT + question) == answer
    assert contexts(server)[0]["reuse_count"] == 2 * len(QUESTIONS)


def test_openai_completions_are_children_too(server):
    server.flush()
    commit = server.generate({"text": CONTEXT, "sampling_params": {"max_new_tokens": 0}})
    assert commit.status_code == 200
    response = requests.post(
        server.url + "/v1/completions",
        json={"model": "demo", "prompt": CONTEXT + QUESTIONS[0], "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert contexts(server)[0]["reuse_count"] == 1
    assert response.json()["choices"][0]["text"] == child_answer(server, CONTEXT + QUESTIONS[0])


# --- beginnings no client marked (--kvx-auto-context-min-tokens) -------------------------------


@pytest.fixture
def auto_server(shared_server):
    """The shared chunked-prefill hybrid: KeyDiff by default, --kvx-auto-context-min-tokens 64."""
    return shared_server("chunked", "tiny-hybrid-deep")


def wait_for_contexts(server, count: int = 1, timeout: float = 60.0) -> list[dict]:
    import time

    deadline = time.monotonic() + timeout
    while len(contexts(server)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return contexts(server)


def test_raw_clients_repeating_a_document_get_it_compacted_unasked(auto_server, references):
    """Plain requests (no marking at all) that repeat a long beginning: the server compacts their
    common beginning as a parent of its own; the request that showed the repeat waits for it and is
    its child, and so is a later question, each answered as the HF oracle answers from the same keep-set."""
    server, ref = auto_server, references["tiny-hybrid-deep"]
    server.flush()
    queued = server.stats()["auto_contexts_queued"]
    prompts = [ref.encode(CONTEXT + question) for question in QUESTIONS]

    def ask(ids, n=6):
        response = server.generate({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}})
        assert response.status_code == 200, response.text
        return response.json()

    waited = server.stats()["children_waited_for_repeated_beginnings"]
    first = ask(prompts[0])
    assert "kvx" not in first["meta_info"] or not first["meta_info"]["kvx"]  # plain, served as usual
    second = ask(prompts[1])  # repeats the first's beginning: waits for it, not prefilling it beside the parent
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    [entry] = wait_for_contexts(server)
    assert entry["context_tokens"] == shared and entry["policy"] == "keydiff"
    stats = server.stats()
    assert stats["auto_contexts_queued"] - queued == 1 and stats["children_waited_for_repeated_beginnings"] == waited + 1
    third = ask(prompts[2])
    keep = [torch.tensor(layer) for layer in requests.get(server.url + "/kvx/keep_sets", timeout=30).json()[0]["positions"]]
    for prompt, body in ((prompts[1], second), (prompts[2], third)):
        assert body["meta_info"]["kvx"][-1]["child"] is True, body["meta_info"]
        expected, _ = ref.compacted_generate(prompt[:shared], keep, prompt[shared:], 6)
        assert body["output_ids"] == expected


def test_the_frontends_threaded_fork_gets_its_document_compacted(auto_server):
    """SGLang's frontend default (run() on its executor thread) may fork before the document is
    applied, so it marks nothing; the forks repeat the document, which the server then compacts,
    and the next program's forks are its children."""
    import sglang as sgl

    @sgl.function
    def ask_all(s, context, questions):
        s += context
        forks = s.fork(len(questions))
        for fork, question in zip(forks, questions):
            fork += question + sgl.gen("answer", max_tokens=6, temperature=0)
        s["answers"] = [fork["answer"] for fork in forks]

    server = auto_server
    server.flush()
    backend = sgl.RuntimeEndpoint(server.url)
    ask_all.run(context=CONTEXT, questions=QUESTIONS, backend=backend)  # the default: threaded
    assert wait_for_contexts(server), server.stats()
    ask_all.run(context=CONTEXT, questions=QUESTIONS, backend=backend)
    assert sum(c["reuse_count"] for c in contexts(server)) >= len(QUESTIONS)
