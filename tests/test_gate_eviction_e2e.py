"""Learned-gate eviction served by SGLang (``--kvx-decode sigmoid-gate``) against the HF oracle.

A real SGLang server per gated cell (sigmoid + RoPE, softmax + NoPE: both attention kinds and both
position treatments) serves the checkpoint through SGLang's model registry and the ``kvx_gated``
attention backend. The oracle is the transformers model applying the paper's rule
(``reference/gated.py: gate_rule``) in one teacher-forced forward over the prompt and the server's
tokens: every greedy token must be its argmax, and every log-probability within 1e-4 (float32),
after the prefill and through 128 decode steps. Bad flags fail before the model loads.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_kvx.models.gated import KvxGatedForCausalLM, register
from sglang_kvx.reference.gated import gate_rule, live_entries, window_rule

from gated_cells import cell_path
from gated_cells import generate as generate_greedy
from gated_cells import split_prompt as read_test_prompt
from server_pool import spec

pytestmark = pytest.mark.slow

CELLS = ("sigmoid-rope-gate", "softmax-nope-gate")
SERVER_TAU = 0.05
PROMPT_LEN, NEW_TOKENS = 200, 128


def split_prompt(cell: str, length: int = PROMPT_LEN) -> list[int]:
    return read_test_prompt(cell, length)


@pytest.fixture(scope="module")
def oracle_models() -> dict[str, KvxGatedForCausalLM]:
    register()
    return {cell: KvxGatedForCausalLM.from_pretrained(cell_path(cell), dtype=torch.float32).eval() for cell in CELLS}


def gated_spec(cell: str, *args: str):
    return spec(cell_path(cell), "--dtype", "float32", *args,
                "--kvx-decode", json.dumps({"step": "sigmoid-gate", "tau": SERVER_TAU}), max_total_tokens=4096)


@pytest.fixture(scope="module", params=CELLS)
def cell(request) -> str:
    """The cell's name; module-scoped, so the file's tests run grouped by cell (one server at a time)."""
    return request.param


@pytest.fixture
def gated_server(cell, server_pool, oracle_models):
    return cell, server_pool.get(gated_spec(cell)), oracle_models[cell]


def generate(server, ids: list[int], decode: dict | None = None) -> dict:
    return generate_greedy(server, ids, decode, NEW_TOKENS)


@torch.no_grad()
def oracle(model: KvxGatedForCausalLM, prompt: list[int], output: list[int], tau: float):
    """Log-probabilities of every next token after the prefill and each decode step, and the gates."""
    ids = torch.tensor([prompt + output[:-1]])
    rules = [gate_rule(tau, len(prompt))] * model.config.num_hidden_layers
    out = model(ids, keep_fns=rules)
    logprobs = torch.log_softmax(out.logits[0, len(prompt) - 1 :].float(), dim=-1)
    return logprobs, out.gates


@pytest.mark.parametrize("tau", [None, 0.2, 0.0])  # None: the server's --kvx-decode tau
def test_served_tokens_and_logprobs_match_the_oracle(gated_server, tau) -> None:
    cell, server, model = gated_server
    prompt = split_prompt(cell)
    decode = {"step": "sigmoid-gate"} if tau is None else {"step": "sigmoid-gate", "tau": tau}
    result = generate(server, prompt, decode)
    tau = SERVER_TAU if tau is None else tau
    output = result["output_ids"]
    served = torch.tensor([lp[0] for lp in result["meta_info"]["output_token_logprobs"]])
    assert len(output) == NEW_TOKENS
    logprobs, gates = oracle(model, prompt, output, tau)
    assert logprobs.argmax(-1).tolist() == output  # greedy tokens
    want = logprobs[torch.arange(NEW_TOKENS), torch.tensor(output)]
    assert torch.allclose(served, want, atol=1e-4), float((served - want).abs().max())
    # What the server says it deleted is what the rule deletes: per layer, the keys cached at the last step.
    report = result["meta_info"]["kvx"][0]
    assert report["decode"] == "sigmoid-gate" and report["tau"] == tau
    cached = len(prompt) + NEW_TOKENS - 1
    live = {str(l + 1): int((g[0, :cached] >= tau).sum()) for l, g in enumerate(gates)}
    assert report["live_entries_per_layer"] == live
    deleted = sum(cached - n for n in live.values())
    assert report["deleted_at_prefill"] + report["deleted_at_decode"] == deleted
    assert report["deleted_at_prefill"] == sum(int((g[0, : len(prompt)] < tau).sum()) for g in gates)
    assert live_entries(gates, tau, cached) == cached + sum(live.values())
    if tau > 0:
        assert deleted > 0  # the rule bites at this tau on these checkpoints
        # Re-folded at step 64: the generated stretch's deleted entries went back to the pool, and the
        # answer above (after the fold, read from the fold's cells) is still the oracle's.
        assert report["folds"] == 1 and report["freed_bytes"] > 0
    else:
        assert report["folds"] == 0 and report["freed_bytes"] == 0


def test_window_steps_run_the_familys_own_attention(gated_server) -> None:
    """A per-request StreamingLLM step on a learned-gate checkpoint (it used to kill the scheduler:
    the generic per-layer path, plain softmax, refused the layer's key gate): each decode step reads
    the sinks and the window through the family's attention, as the oracle applying the same window."""
    cell, server, model = gated_server
    prompt = split_prompt(cell)
    sinks, window = 4, 48
    result = generate(server, prompt, {"step": "streamingllm", "sinks": sinks, "window": window})
    output = result["output_ids"]
    served = torch.tensor([lp[0] for lp in result["meta_info"]["output_token_logprobs"]])
    with torch.no_grad():
        out = model(torch.tensor([prompt + output[:-1]]),
                    keep_fns=[window_rule(sinks, window, len(prompt))] * model.config.num_hidden_layers)
    logprobs = torch.log_softmax(out.logits[0, len(prompt) - 1 :].float(), dim=-1)
    assert logprobs.argmax(-1).tolist() == output
    want = logprobs[torch.arange(NEW_TOKENS), torch.tensor(output)]
    assert torch.allclose(served, want, atol=1e-4), float((served - want).abs().max())
    full, _ = oracle(model, prompt, output, 0.0)
    assert not torch.allclose(full[torch.arange(NEW_TOKENS), torch.tensor(output)], want, atol=1e-3)  # the window bites


def test_eviction_changes_what_is_generated(gated_server) -> None:
    """The deletions reach attention: a high threshold gives other log-probabilities than none
    (and the oracle above agrees with each)."""
    cell, server, _ = gated_server
    prompt = split_prompt(cell)
    none = generate(server, prompt, {"step": "sigmoid-gate", "tau": 0.0})["meta_info"]["output_token_logprobs"]
    high = generate(server, prompt, {"step": "sigmoid-gate", "tau": 0.5})["meta_info"]["output_token_logprobs"]
    assert [lp[0] for lp in none] != [lp[0] for lp in high]


@pytest.mark.parametrize("decode,message", [
    ({"step": "sigmoid-gate", "tau": 1.0}, "tau must be in [0, 1)"),
    ({"step": "sigmoid-gate", "tau": -0.1}, "tau must be in [0, 1)"),
    ({"step": "sigmoid-gate", "tau": "high"}, "custom_params.kvx.decode.tau must be a finite number"),
])
def test_bad_thresholds_are_refused_and_the_server_keeps_serving(gated_server, decode, message) -> None:
    cell, server, _ = gated_server
    payload = {"input_ids": split_prompt(cell, 20),
               "sampling_params": {"max_new_tokens": 2, "custom_params": {"kvx": {"decode": decode}}}}
    response = server.generate(payload)
    assert response.status_code == 400 and message in response.text, response.text
    assert generate(server, split_prompt(cell, 20))["meta_info"]["completion_tokens"] == NEW_TOKENS


def test_stats_report_gate_deletions_and_the_pool_balances(gated_server) -> None:
    cell, server, _ = gated_server
    before = server.stats()
    generate(server, split_prompt(cell, 50), {"step": "sigmoid-gate", "tau": 0.3})
    stats = server.stats()
    assert stats["gate_folds"] > before["gate_folds"] and stats["gate_freed_bytes"] > before["gate_freed_bytes"]
    assert stats["gate_requests"] == []  # none running now
    server.flush()
    idle = server.stats()
    assert idle["kv_pool_free_tokens"] + idle["kv_pool_evictable_tokens"] == idle["kv_pool_total_tokens"]  # nothing leaked
    assert stats["gate_eviction_requests"] == before["gate_eviction_requests"] + 1
    layers = stats["gate_deleted_per_layer"]
    assert len(layers) == 4 and layers[0] == {"prefill": 0, "decode": 0}  # layer 0 has no gate
    deleted = lambda figures: sum(layer["prefill"] + layer["decode"] for layer in figures["gate_deleted_per_layer"])  # noqa: E731
    assert deleted(stats) > deleted(before)
    assert stats["gate_deleted_bytes"] == sum(l["prefill"] + l["decode"] for l in layers) * 2 * 128 * 4


def test_running_requests_report_their_live_entries(gated_server) -> None:
    """While a request decodes, /kvx/stats lists its live entries per layer."""
    import threading

    cell, server, _ = gated_server
    payload = {"input_ids": split_prompt(cell, 100), "sampling_params": {
        "max_new_tokens": 400, "temperature": 0, "ignore_eos": True,
        "custom_params": {"kvx": {"decode": {"step": "sigmoid-gate", "tau": 0.3}}}}}
    worker = threading.Thread(target=server.generate, args=(payload,))
    worker.start()
    seen = []
    while worker.is_alive() and not seen:
        seen = server.stats()["gate_requests"]
    worker.join()
    assert seen, "the request finished before a stats poll saw it"
    report = seen[0]
    assert report["tau"] == 0.3 and sorted(report["live_entries_per_layer"]) == ["1", "2", "3"]


def test_without_the_radix_cache_the_prompt_entries_are_freed_too(server_pool, oracle_models) -> None:
    """With the radix cache on, the prompt's KV belongs to the prefix cache and only the generated
    stretch is re-folded; with ``--disable-radix-cache`` the request owns its prompt, so the fold
    also returns the prompt's deleted entries to the pool. Same tokens as the oracle either way.
    (One cell, the one the file's other tests use last, so its server is still up: what is freed
    does not depend on the attention kind.)"""
    cell = CELLS[-1]
    model = oracle_models[cell]
    cached_server = server_pool.get(gated_spec(cell))
    server = server_pool.get(gated_spec(cell, "--disable-radix-cache"))
    prompt = split_prompt(cell)
    decode = {"step": "sigmoid-gate", "tau": 0.2}
    uncached = generate(server, prompt, decode)
    server.flush()
    idle = server.stats()
    assert idle["kv_pool_free_tokens"] == idle["kv_pool_total_tokens"]  # every slot back, none twice
    cached = generate(cached_server, prompt, decode)
    assert uncached["output_ids"] == cached["output_ids"]
    logprobs, gates = oracle(model, prompt, uncached["output_ids"], 0.2)
    assert logprobs.argmax(-1).tolist() == uncached["output_ids"]
    deleted_in_prompt = sum(int((g[0, : len(prompt)] < 0.2).sum()) for g in gates)
    assert deleted_in_prompt > 0
    freed = uncached["meta_info"]["kvx"][0]["freed_bytes"], cached["meta_info"]["kvx"][0]["freed_bytes"]
    assert freed[0] > freed[1] > 0, freed
