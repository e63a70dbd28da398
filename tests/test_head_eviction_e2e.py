"""Online H2O and KeyDiff served as decode steps (``h2o``, ``keydiff``) against the HF oracle.

The learned-gate paper's post-hoc baselines, served on the dense (no-gate) cells of the family
through the ``kvx_gated`` backend, each attention kind once. The oracle is the transformers model
applying the protocol's own rules (``reference/gated.py: h2o_rule, keydiff_rule``) in one
teacher-forced forward over the prompt and the server's tokens: every greedy token must be its
argmax, every log-probability within 1e-4 (float32), through 128 decode steps, with each head over
its budget evicting at every step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_kvx.models.gated import KvxGatedForCausalLM, register
from sglang_kvx.reference.gated import h2o_rule, keydiff_rule, window_rule

from gated_cells import cell_path, split_prompt
from gated_cells import generate as generate_greedy

pytestmark = pytest.mark.slow

CELLS = ("sigmoid-rope-none", "softmax-nope-none")
PROMPT_LEN, NEW_TOKENS = 200, 128


@pytest.fixture(scope="module")
def oracle_models() -> dict[str, KvxGatedForCausalLM]:
    register()
    return {cell: KvxGatedForCausalLM.from_pretrained(cell_path(cell), dtype=torch.float32).eval() for cell in CELLS}


@pytest.fixture(scope="module", params=CELLS)
def cell(request) -> str:
    """The cell's name; module-scoped, so the file's tests run grouped by cell (one server at a time)."""
    return request.param


@pytest.fixture
def dense_server(cell, shared_server, oracle_models):
    return cell, shared_server("gated_cell", cell), oracle_models[cell]


def generate(server, ids: list[int], decode: dict | None, new_tokens: int = NEW_TOKENS) -> dict:
    return generate_greedy(server, ids, decode, new_tokens)


@torch.no_grad()
def oracle_logprobs(model: KvxGatedForCausalLM, prompt: list[int], output: list[int], rule) -> torch.Tensor:
    out = model(torch.tensor([prompt + output[:-1]]), keep_fns=[rule] * model.config.num_hidden_layers)
    return torch.log_softmax(out.logits[0, len(prompt) - 1 :].float(), dim=-1)


@pytest.mark.parametrize("step,budget", [("h2o", 64), ("keydiff", 64), ("h2o", 256)])
def test_served_tokens_and_logprobs_match_the_oracle(dense_server, step, budget) -> None:
    cell, server, model = dense_server
    prompt = split_prompt(cell, PROMPT_LEN)
    result = generate(server, prompt, {"step": step, "budget": budget})
    output = result["output_ids"]
    served = torch.tensor([lp[0] for lp in result["meta_info"]["output_token_logprobs"]])
    kind = model.config.attention
    rule = h2o_rule(budget, len(prompt), kind) if step == "h2o" else keydiff_rule(budget, len(prompt))
    logprobs = oracle_logprobs(model, prompt, output, rule)
    assert logprobs.argmax(-1).tolist() == output  # greedy tokens
    want = logprobs[torch.arange(NEW_TOKENS), torch.tensor(output)]
    assert torch.allclose(served, want, atol=1e-4), float((served - want).abs().max())
    # Each head holds its budget (or everything, below it) after the last step.
    report = result["meta_info"]["kvx"][0]
    cached = len(prompt) + NEW_TOKENS - 1
    assert report["decode"] == step and report["budget"] == budget
    layers = model.config.num_hidden_layers
    assert report["live_entries_per_layer"] == {str(l): float(min(budget, cached)) for l in range(layers)}
    assert report["evicted_entries"] == max(cached - budget, 0) * layers * model.config.num_attention_heads


def test_window_steps_match_the_oracle(dense_server) -> None:
    """StreamingLLM at decode time on a dense cell runs the cell's own attention (sigmoid with its
    bias, or softmax) over sinks and window: the generic per-layer path used to compute plain softmax."""
    cell, server, model = dense_server
    prompt = split_prompt(cell, PROMPT_LEN)
    sinks, window = 4, 48
    result = generate(server, prompt, {"step": "streamingllm", "sinks": sinks, "window": window})
    output = result["output_ids"]
    served = torch.tensor([lp[0] for lp in result["meta_info"]["output_token_logprobs"]])
    logprobs = oracle_logprobs(model, prompt, output, window_rule(sinks, window, len(prompt)))
    assert logprobs.argmax(-1).tolist() == output
    want = logprobs[torch.arange(NEW_TOKENS), torch.tensor(output)]
    assert torch.allclose(served, want, atol=1e-4), float((served - want).abs().max())


def novelty_rule(budget: int, prefill_len: int):
    """The oracle of ``tests/throwaway_decode.py``'s step, written out independently: each head keeps
    the ``budget`` prefill keys least like (cosine) the last prefill key, that one included, and once a
    step takes it past the budget evicts its kept key most like the key just written (never that one)."""

    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        b, h, t, _ = k.shape
        out = torch.ones((b, h, t, t), dtype=torch.bool, device=k.device)
        for batch in range(b):
            keys = k[batch].float()  # [H, T, D]
            kept = torch.zeros((h, t), dtype=torch.bool, device=k.device)
            if budget >= prefill_len:
                kept[:, :prefill_len] = True
            else:
                last = prefill_len - 1
                similarity = F.cosine_similarity(keys[:, :prefill_len], keys[:, last : last + 1], dim=-1)
                similarity[:, last] = float("-inf")
                kept.scatter_(1, similarity.topk(budget, dim=-1, largest=False).indices, True)
            for i in range(prefill_len, t):
                visible = kept.clone()
                visible[:, i] = True
                out[batch, :, i] = visible
                kept[:, i] = True
                if int(kept[0].sum()) > budget:
                    similarity = F.cosine_similarity(keys[:, : i + 1], keys[:, i : i + 1], dim=-1)
                    candidates = kept[:, : i + 1].clone()
                    candidates[:, i] = False
                    kept[torch.arange(h), similarity.masked_fill(~candidates, float("-inf")).argmax(dim=-1)] = False
        return out

    return keep


def test_a_decode_step_from_outside_the_package_is_served_like_the_oracle(dense_server) -> None:
    """Issue #40's proof: a decode step with a mechanism and counters of its own, one file outside the
    package (``tests/throwaway_decode.py``, loaded with --kvx-policy-modules), served end to end
    through the generic per-row state: tokens and log-probabilities equal the HF oracle applying the
    same rule; its own report is in meta_info and its own figures in /kvx/stats."""
    cell, server, model = dense_server
    prompt = split_prompt(cell, PROMPT_LEN)
    budget = 64
    before = server.stats()
    result = generate(server, prompt, {"step": "_throwaway_novelty", "budget": budget})
    output = result["output_ids"]
    served = torch.tensor([lp[0] for lp in result["meta_info"]["output_token_logprobs"]])
    logprobs = oracle_logprobs(model, prompt, output, novelty_rule(budget, len(prompt)))
    assert logprobs.argmax(-1).tolist() == output
    want = logprobs[torch.arange(NEW_TOKENS), torch.tensor(output)]
    assert torch.allclose(served, want, atol=1e-4), float((served - want).abs().max())
    report = result["meta_info"]["kvx"][0]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    cached = len(prompt) + NEW_TOKENS - 1
    assert report["decode"] == "_throwaway_novelty" and -1 <= report["most_similar_evicted"] <= 1
    assert report["evicted_entries"] == (cached - budget) * layers * heads
    after = server.stats()
    assert after["_throwaway_novelty_finished"] - before["_throwaway_novelty_finished"] == 1
    assert after["_throwaway_novelty_evicted"] - before["_throwaway_novelty_evicted"] == (cached - budget) * layers * heads
    assert after["_throwaway_novelty_requests"] == []


def test_eviction_changes_what_is_generated(dense_server) -> None:
    """The budget reaches attention: a small one gives other log-probabilities than a full cache
    (and the oracle above agrees with each)."""
    cell, server, _ = dense_server
    prompt = split_prompt(cell, PROMPT_LEN)[:150]
    full = generate(server, prompt, None, 32)["meta_info"]["output_token_logprobs"]
    for step in ("h2o", "keydiff"):
        small = generate(server, prompt, {"step": step, "budget": 16}, 32)["meta_info"]["output_token_logprobs"]
        assert [lp[0] for lp in full] != [lp[0] for lp in small]


def test_h2o_prefills_its_whole_context_and_the_pool_balances(dense_server) -> None:
    """H2O scores every entry by what all the context's queries paid it, so a request repeating a
    cached prompt still prefills it whole (and gets the uncached answer); nothing leaks."""
    cell, server, _ = dense_server
    prompt = split_prompt(cell, PROMPT_LEN)[:120]
    decode = {"step": "h2o", "budget": 32}
    before = server.stats()
    first = generate(server, prompt, decode, 16)
    again = generate(server, prompt, decode, 16)
    assert again["meta_info"]["cached_tokens"] == 0
    assert [lp[0] for lp in again["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp[0] for lp in first["meta_info"]["output_token_logprobs"]], abs=1e-5)
    stats = server.stats()
    assert stats["head_eviction_finished"] - before["head_eviction_finished"] == 2
    assert stats["head_evicted_entries"] > before["head_evicted_entries"]
    assert stats["head_eviction_requests"] == []
    server.flush()
    idle = server.stats()
    assert idle["kv_pool_free_tokens"] + idle["kv_pool_evictable_tokens"] == idle["kv_pool_total_tokens"]


@pytest.mark.parametrize("decode,message", [
    ({"step": "h2o", "budget": 1}, "budget must be >= 2"),
    ({"step": "keydiff", "budget": 0}, "budget must be >= 1"),
    ({"step": "h2o", "budget": "all"}, "custom_params.kvx.decode.budget must be a whole number"),
    ({"step": "sigmoid-gate", "tau": 0.1}, "needs learned_gates, which this model does not provide"),
])
def test_bad_settings_are_refused_and_the_server_keeps_serving(dense_server, decode, message) -> None:
    cell, server, _ = dense_server
    payload = {"input_ids": split_prompt(cell, 20),
               "sampling_params": {"max_new_tokens": 2, "custom_params": {"kvx": {"decode": decode}}}}
    response = server.generate(payload)
    assert response.status_code == 400 and message in response.text, response.text
    assert generate(server, split_prompt(cell, 20), None, 4)["meta_info"]["completion_tokens"] == 4
