"""``--kvx-sparse-attention``: block-sparse attention served by SGLang against the HF oracle.

The shared sparse server per demo model (the dense Llama and the Qwen3.5-architecture hybrid), every attention
layer of every request attending through the kernel layer's block-sparse ops; the oracle is the
transformers model with the rule written out in ``reference/sparse.py``. Greedy tokens equal and
log-probabilities within 1e-4 over the prefill and the decode steps, with the budget biting (the
prompt holds several times as many blocks as a query reads); a repeated prompt (prefix-cache hit)
gives the same; a bad budget fails before the model loads.
"""

from __future__ import annotations

import random

import pytest

import requests
import torch

from sglang_kvx.reference.sparse import sparse_compacted_generate, sparse_greedy
from server_pool import SPARSE_BUDGET

from test_cli import our_error_lines

BUDGET = SPARSE_BUDGET  # tokens per query: 8 blocks of a 150-token prompt's 38
PROMPT_LEN, NEW_TOKENS = 150, 24


@pytest.fixture
def sparse_server(demo_model, shared_server, references):
    return demo_model, shared_server("sparse", demo_model), references[demo_model]


def generate(server, ids: list[int]) -> tuple[list[int], list[float], dict]:
    response = server.generate({"input_ids": ids, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["output_ids"], [lp[0] for lp in body["meta_info"]["output_token_logprobs"]], body["meta_info"]


@pytest.mark.slow
def test_served_tokens_and_logprobs_match_the_oracle(sparse_server) -> None:
    name, server, reference = sparse_server
    prompt = [random.Random(7).randrange(10, 500) for _ in range(PROMPT_LEN)]
    built = server.stats()["sparse_index_blocks_built"]
    tokens, logprobs, _ = generate(server, prompt)
    # The index is kept: the prefill builds the prompt's blocks, each decode step at most the block
    # its token is in and the one before (rebuilding every block each step would be ~20x more).
    layers = len(reference.attention_layer_ids)
    built = server.stats()["sparse_index_blocks_built"] - built
    assert layers * -(-PROMPT_LEN // 4) <= built <= layers * (-(-PROMPT_LEN // 4) + 2 * NEW_TOKENS)
    want_tokens, want_logprobs = sparse_greedy(reference, prompt, NEW_TOKENS, BUDGET)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
    # The budget bites: dense attention gives other log-probabilities (the tokens may still agree).
    assert reference.prompt_logprobs(prompt + tokens)[-NEW_TOKENS:] != pytest.approx(logprobs, abs=1e-4)
    # The prompt again, served from the prefix cache: committed first without its last token, so that
    # the hybrid holds its GDN states exactly there (SGLang caches them where a request ends).
    assert server.generate({"input_ids": prompt[:-1], "sampling_params": {"max_new_tokens": 0}}).status_code == 200
    again, again_logprobs, meta = generate(server, prompt)
    assert again == tokens and meta["cached_tokens"] == len(prompt) - 1, meta
    assert max(abs(a - b) for a, b in zip(again_logprobs, logprobs)) < 1e-4


@pytest.mark.slow
def test_a_child_of_a_compacted_context_reads_its_regrouped_blocks_like_the_oracle(sparse_server) -> None:
    """QSA: each layer's kept entries regrouped into new blocks (GateSight's gate-proportional
    budgets on the hybrid, PyramidKV's on the dense model: layers keep different counts, the folded
    layout lends cells), the index shrinking to ceil(K_l / 4); the child equals the oracle."""
    name, server, reference = sparse_server
    policy = "gatesight" if name == "tiny-hybrid-deep" else "pyramidkv"
    rng = random.Random(11)
    context = [rng.randrange(10, 500) for _ in range(160)]
    question = [rng.randrange(10, 500) for _ in range(6)]
    allocation = {"allocation": "gate"} if policy == "gatesight" else {}  # GateSight's default budgets are flat
    kvx = {"custom_params": {"kvx": {"policy": policy, "keep_fraction": 0.5, **allocation}}}
    body = {"input_ids": context, "sampling_params": {"max_new_tokens": 0, **kvx}}
    assert server.generate(body).status_code == 200
    entry = [c for c in server.stats()["compacted_contexts"] if c["policy"] == policy][-1]
    kept = entry["kept_entries"]
    assert len(set(kept)) > 1  # per-layer budgets
    assert entry["sparse_index_blocks"] == {"full_context": 40, "regrouped_per_layer": [-(-k // 4) for k in kept]}
    keep = [torch.tensor(layer) for layer in [e for e in requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
                                              if e["policy"] == policy][-1]["positions"]]
    response = server.generate({"input_ids": context + question, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True, **kvx}})
    assert response.status_code == 200, response.text
    served = response.json()
    assert served["meta_info"]["cached_tokens"] > 0  # a child: it read the compacted prefix
    tokens, logprobs = sparse_compacted_generate(reference, context, keep, question, 10, BUDGET)
    assert served["output_ids"] == tokens
    assert max(abs(a[0] - b) for a, b in zip(served["meta_info"]["output_token_logprobs"], logprobs)) < 1e-4
    # Another client's request naming no policy, on this server without one, is plain: the stored context
    # is not its business (it used to get 400 "policy is needed" until /flush_cache).
    plain, plain_logprobs, meta = generate(server, context + question)
    assert meta["cached_tokens"] == 0 and not meta.get("kvx")
    want_tokens, want_logprobs = sparse_greedy(reference, context + question, NEW_TOKENS, BUDGET)
    assert plain == want_tokens and max(abs(a - b) for a, b in zip(plain_logprobs, want_logprobs)) < 1e-4
    server.flush()
    idle = server.stats()
    assert idle["kv_pool_free_tokens"] + idle["kv_pool_evictable_tokens"] == idle["kv_pool_total_tokens"]  # nothing leaked


@pytest.mark.slow
def test_decode_steps_asked_per_request_are_refused(sparse_server) -> None:
    """The launcher refuses --kvx-decode beside --kvx-sparse-attention; a request's own step was served,
    and its tokens then depended on the requests running beside it (block-sparse attention read the
    slots a StreamingLLM step had freed, which other requests reuse)."""
    name, server, reference = sparse_server
    prompt = [random.Random(5).randrange(10, 500) for _ in range(PROMPT_LEN)]
    for decode in ({"step": "streamingllm", "window": 32}, {"step": "span_schedule"}):
        response = server.generate({"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "custom_params": {"kvx": {"decode": decode}}}})
        assert response.status_code == 400 and "--kvx-sparse-attention" in response.text, response.text
    assert generate(server, prompt)[0] == sparse_greedy(reference, prompt, NEW_TOKENS, BUDGET)[0]


@pytest.mark.parametrize("value,expected", [
    ("32 --kvx-decode streamingllm", "--kvx-sparse-attention cannot be combined with decode-time steps yet"),
    ("30", "--kvx-sparse-attention must be 0 or a multiple of 4 of at least 8 (the first block and a query's own), got 30"),
    ("4", "--kvx-sparse-attention must be 0 or a multiple of 4 of at least 8 (the first block and a query's own), got 4"),
    ("many", "--kvx-sparse-attention must be a whole number >= 0, got 'many'"),
])
def test_bad_budgets_fail_before_the_model_loads(launch_parser, demo_paths, value, expected) -> None:
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024", "--kvx-sparse-attention", *value.split())
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [f"sglang-kvx: error: {expected}"]


@pytest.mark.slow
def test_tokens_do_not_depend_on_what_else_runs(sparse_server) -> None:
    """Determinism under block-sparse attention (issue #41): a request's tokens and log-probabilities
    are the same sent alone and sent with three others of other lengths in one concurrent mix (the
    index and the block selection are per row: no state shared over a batch)."""
    from concurrent.futures import ThreadPoolExecutor

    name, server, reference = sparse_server
    prompts = [[random.Random(40 + i).randrange(10, 500) for _ in range(PROMPT_LEN - 30 * i)] for i in range(4)]
    alone = [generate(server, p)[:2] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: generate(server, p)[:2], prompts))
    for (tokens, logprobs), (again, again_logprobs) in zip(alone, together):
        assert again == tokens
        assert max(abs(a - b) for a, b in zip(logprobs, again_logprobs)) < 1e-4
    assert alone[0][0] == sparse_greedy(reference, prompts[0], NEW_TOKENS, BUDGET)[0]
