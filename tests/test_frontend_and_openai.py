"""Children from SGLang's frontend language (fork after a shared context) and from the OpenAI API."""

from __future__ import annotations

import pytest
import requests

from sglang_kvx.serve.launcher import ServerProcess

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


@pytest.fixture(scope="module")
def server(demo_paths):
    with ServerProcess(demo_paths["tiny-hybrid-deep"], "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5",
                       max_total_tokens=8192) as server:
        yield server


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
