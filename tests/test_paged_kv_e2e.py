"""Paged KV (``--page-size`` > 1): a compacted context fills whole pages of SGLang's pool.

A child continues after its context's slots; SGLang's paged allocator puts a request's next token
in the same page as its last one unless that page is full. So the kept entries are raised to fill
the context's last page (``allocate.fill_pages``): children then write on pages of their own, and
every slot SGLang or the store frees is part of a whole page. Checked on the real server at page
size 16 against the HF oracle applying the same keep-set, with exact page accounting. (Hybrid GDN
models run with page size 1 on CPU: SGLang's ``no_buffer`` GDN cache strategy refuses others.)
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from sglang_kvx.allocate import fill_pages
from sglang_kvx.compact.layout import fold_layers
from sglang_kvx.models.tokenizer import WORDS
from sglang_kvx.policies import get_policy
from sglang_kvx.reference.signals import context_signals
from sglang_kvx.select import choose_keep_set
from server_pool import spec

PAGE = 16
POOL = 8192
GREEDY = {"temperature": 0.0, "ignore_eos": True}


# --- the budgets -----------------------------------------------------------------------


def test_flat_budgets_round_up_to_whole_pages() -> None:
    assert fill_pages([120] * 4, 399, 0, 16) == [128] * 4
    assert fill_pages([128] * 4, 399, 0, 16) == [128] * 4  # already whole pages
    # The protected prefix counts towards the slots: 5 + 120 = 125 -> 128.
    assert fill_pages([120] * 4, 394, 5, 16) == [123] * 4
    assert fill_pages([120] * 4, 399, 0, 1) == [120] * 4


def test_folded_budgets_fill_the_pages_smallest_layer_first() -> None:
    budgets = [300, 20, 50, 10]  # 380 entries over 4 layers: 95 slots -> 96 (6 pages) -> 4 more entries
    filled = fill_pages(budgets, 1000, 0, 16)
    assert sum(filled) == 4 * 96 and filled == [300, 20, 50, 14]
    assert fold_layers(filled).num_slots == 96
    # Unfolded (one slot per rank of the largest layer): every layer fills the paged slots.
    assert fill_pages(budgets, 1000, 0, 16, fold=False) == [304] * 4


def test_budgets_never_exceed_the_context() -> None:
    # 390 of 399 entries -> 400 slots would be needed: capped at the context (nothing to free).
    filled = fill_pages([390] * 2, 399, 0, 16)
    assert filled == [399, 399]
    assert fold_layers(filled).num_slots % 16 != 0
    with pytest.raises(ValueError):
        fill_pages([1], 10, 0, 0)


# --- the server ------------------------------------------------------------------------


def paged_spec(path: str):
    """The paged server of this file (the combination matrix serves its features on it too)."""
    return spec(path, "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.3",
                "--page-size", str(PAGE), "--context-length", "4096", max_total_tokens=POOL)


@pytest.fixture
def paged(demo_paths, references, server_pool):
    name = "tiny-llama"
    return server_pool.get(paged_spec(demo_paths[name])), references[name], demo_paths[name]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "\n"


def kvx(policy: str, keep_fraction: float, protected: int = 0) -> dict:
    return {"custom_params": {"kvx": {"policy": policy, "keep_fraction": keep_fraction, "protected_prefix_len": protected}}}


def generate(server, input_ids, max_new_tokens, sampling) -> dict:
    response = server.generate({"input_ids": input_ids, "return_logprob": True,
                                "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens, **sampling}})
    assert response.status_code == 200, response.text
    return response.json()


def served_keep_set(server, n: int, policy: str, keep_fraction: float) -> list[torch.Tensor]:
    entries = [e for e in requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
               if e["context_tokens"] == n and e["policy"] == policy and e["keep_fraction"] == keep_fraction]
    assert len(entries) == 1
    return [torch.tensor(layer) for layer in entries[0]["positions"]]


def pool_balances(server) -> dict:
    stats = server.stats()
    assert stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"] + stats["store_slots"] == POOL, stats
    return stats


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "keep_fraction", "words_in_context", "protected"),
    [("keydiff", 0.3, 260, 5), ("snapkv", 0.1, 300, 0), ("pyramidkv", 0.5, 2000, 3)],
)
def test_children_of_a_paged_context_match_the_oracle(paged, policy, keep_fraction, words_in_context, protected) -> None:
    """Whole pages held, the oracle's tokens and log-probabilities for children asked one at a time
    and two at once (they share the context's pages and write on their own)."""
    server, ref, _path = paged
    context = ref.encode(words(words_in_context, seed=len(policy) * 1000 + words_in_context))
    questions = [ref.encode(f"Question {i}: which word comes next? Answer:") for i in range(3)]
    free_before = pool_balances(server)["kv_pool_free_tokens"]
    generate(server, context, 0, kvx(policy, keep_fraction, protected))
    stats = pool_balances(server)
    (entry,) = [c for c in stats["compacted_contexts"] if c["policy"] == policy]
    offline = choose_keep_set(get_policy(policy)(), context_signals(ref, context, protected_prefix_len=protected),
                              keep_fraction, page_size=PAGE)
    assert entry["kept_entries"] == offline.kept_per_layer
    assert entry["slots"] % PAGE == 0 and entry["slots"] == fold_layers(offline.kept_per_layer).num_slots
    if policy == "pyramidkv":  # a real pyramid: layers keep different counts, folded into the pages
        assert len(set(entry["kept_entries"])) > 1 and entry["folded_entries"] > 0
    # The parent's pages beyond the kept ones went back to the pool, whole.
    assert free_before - stats["kv_pool_free_tokens"] - stats["kv_pool_evictable_tokens"] <= entry["slots"]
    keep = served_keep_set(server, len(context), policy, keep_fraction)
    sampling = kvx(policy, keep_fraction, protected)
    one_by_one = [generate(server, context + q, 8, sampling) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: generate(server, context + q, 8, sampling), questions))
    for question, alone, concurrent in zip(questions, one_by_one, together):
        expected_ids, expected_lp = ref.compacted_generate(context, keep, question, 8)
        assert alone["output_ids"] == expected_ids == concurrent["output_ids"], policy
        for body in (alone, concurrent):
            served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4
            assert body["meta_info"]["kvx"][-1]["slots"] == entry["slots"] and body["meta_info"]["cached_tokens"] == len(context)
    pool_balances(server)
    server.flush()
    stats = server.stats()
    assert stats["kv_pool_free_tokens"] == POOL and stats["store_slots"] == 0


@pytest.mark.slow
def test_plain_requests_keep_page_granular_prefix_matches(paged) -> None:
    server, ref, _path = paged
    prompt = ref.encode(words(70, seed=5))
    first = generate(server, prompt, 4, {})
    again = generate(server, prompt + ref.encode(" more"), 4, {})
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == (len(prompt) // PAGE) * PAGE
    server.flush()


@pytest.mark.slow
def test_what_cannot_fill_pages_is_refused_or_left_uncompacted(paged) -> None:
    server, ref, _path = paged
    # Kept entries that, in whole pages, cover the whole context: served uncompacted, with the reason.
    context = ref.encode(words(60, seed=9))[:70]  # 5 pages' worth (80 slots) is more than 70 tokens
    assert len(context) == 70
    skipped = server.stats()["compactions_skipped_keeps_all"]
    body = generate(server, context, 0, kvx("keydiff", 0.97))
    (outcome,) = body["meta_info"]["kvx"]
    assert outcome["compacted"] is False and "nothing would be freed" in outcome["reason"], outcome
    assert server.stats()["compactions_skipped_keeps_all"] == skipped + 1
    # KVzip holds its context for the reconstruction passes in slots that are not whole pages.
    refused = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **kvx("kvzip", 0.3)}})
    assert refused.status_code == 400 and "--page-size 16" in refused.text, refused.text
    server.flush()
    assert server.stats()["kv_pool_free_tokens"] == POOL


@pytest.mark.slow
@pytest.mark.parametrize("decode", [{"step": "streamingllm", "window": 16}, {"step": "span_schedule"},
                                    {"step": "h2o", "budget": 32}, {"step": "keydiff", "budget": 32}])
def test_decode_steps_asked_per_request_are_refused(paged, decode) -> None:
    """The launcher refuses --kvx-decode with pages; the same step asked per request used to be served,
    then its slots were freed twice and the scheduler died on SGLang's leak check."""
    server, ref, _path = paged
    prompt = ref.encode(words(40, seed=3))
    for max_new_tokens in (40, 0):  # a generating request, and a parent (which runs no step)
        response = server.generate({"input_ids": prompt, "sampling_params": {
            **GREEDY, "max_new_tokens": max_new_tokens, "custom_params": {"kvx": {"decode": decode}}}})
        assert response.status_code == 400 and "custom_params.kvx.decode" in response.text, response.text
        assert "--page-size 16" in response.text
    assert generate(server, prompt, 8, {})["meta_info"]["completion_tokens"] == 8  # still serving
    server.flush()
    pool_balances(server)


@pytest.mark.parametrize(
    "flags",
    [["--kvx-policy", "kvzip"], ["--kvx-policy", "keydiff", "--kvx-decode", "streamingllm"],
     ["--kvx-policy", "keydiff", "--kvx-sparse-attention", "64"]],
)
def test_start_up_refuses_what_page_sizes_break(launch_parser, demo_paths, flags) -> None:
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], *flags,
                                 "--kvx-keep-fraction", "0.3", "--page-size", "16", "--max-total-tokens", "4096")
    assert result.returncode == 2 and "--page-size 16" in result.stderr, result.stderr[-2000:]
