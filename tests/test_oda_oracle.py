"""The HF On-Demand Attention oracle (sglang_kvx/reference/oda.py) on the dense and the hybrid demo
models: its fixed schedules reduce to the decoders it must equal, a Full retry after a Local attempt
leaves no trace of the attempt, and the route sees the documented inputs."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_kvx.reference import oda
from sglang_kvx.reference.hf import HFReference

MODELS = ("tiny-llama", "tiny-hybrid-deep")  # dense; the demo hybrid (2 x [3 GDN + 1 attention])
SINKS, WINDOW, NEW = 4, 24, 12


@pytest.fixture(scope="module")
def refs() -> dict[str, HFReference]:
    return {name: HFReference(f"weights/{name}") for name in MODELS}


def prompt(ref: HFReference, n: int = 160, seed: int = 0) -> list[int]:
    vocab = ref.model.config.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", MODELS)
def test_always_full_is_plain_greedy(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.always_full)
    assert result.tokens == ref.greedy(ids, NEW)
    _, full_lp = ref.span_generate(ids, NEW, lambda step: (0, None))
    assert max(abs(a - b) for a, b in zip(result.logprobs, full_lp)) <= 1e-5
    assert result.full_steps == [True] * (NEW - 1)  # N outputs, N - 1 routed steps


@pytest.mark.parametrize("name", MODELS)
def test_always_local_is_the_span_oracle(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.always_local)
    tokens, logprobs = ref.span_generate(ids, NEW, lambda step: (SINKS, WINDOW))
    assert result.tokens == tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) <= 1e-5
    assert result.full_steps == [False] * (NEW - 1)


@pytest.mark.parametrize("name", MODELS)
def test_every_kth_step_full_matches_a_per_step_span_rule(refs, name):
    """Local with a Full re-run on steps k, 2k, ... commits what a decoder reading Full on exactly
    those steps and Local elsewhere commits (the Local attempts leave nothing behind)."""
    ref = refs[name]
    ids = prompt(ref, seed=1)
    result = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.every_kth(3))
    tokens, logprobs = ref.span_generate(ids, NEW, lambda step: (0, None) if step % 3 == 0 else (SINKS, WINDOW))
    assert result.tokens == tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) <= 1e-5
    assert result.full_steps == [step % 3 == 0 for step in range(1, NEW)]


@pytest.mark.parametrize("name", MODELS)
def test_full_retry_after_local_attempt_equals_full_only_step(refs, name):
    ref = refs[name]
    ids = prompt(ref, seed=2)
    cache, _, logits = oda.prefill(ref, ids)
    token, seq_len = int(logits.argmax()), len(ids) + 1
    fresh = copy.deepcopy(cache)
    full_h, full_logits = oda.forward_step(ref, fresh, token, seq_len)
    local_h, _, retry_h, retry_logits, after = oda.paired_step(ref, cache, token, seq_len, SINKS, WINDOW)
    assert torch.equal(retry_h, full_h) and torch.equal(retry_logits, full_logits)
    assert not torch.allclose(local_h, full_h)  # the window mattered
    # and the committed state is the Full-only one: the next step agrees too
    nxt = int(full_logits.argmax())
    a, _ = oda.forward_step(ref, fresh, nxt, seq_len + 1)
    b, _ = oda.forward_step(ref, after, nxt, seq_len + 1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", MODELS)
def test_route_inputs_have_the_documented_shapes(refs, name):
    ref = refs[name]
    ids = prompt(ref, seed=3)
    hidden = ref.model.config.hidden_size
    seen = []

    def route(step, prev_h, emb, local_h):
        seen.append((step, prev_h.clone(), emb.clone(), local_h.clone()))
        return step % 2 == 0

    result = oda.oda_generate(ref, ids, 6, SINKS, WINDOW, route, keep_hidden=True)
    assert [s for s, *_ in seen] == [1, 2, 3, 4, 5]
    for step, prev_h, emb, local_h in seen:
        for x in (prev_h, emb, local_h):
            assert x.shape == (hidden,) and x.dtype == torch.float32
        # prev_h: the committed final hidden of the previous step (the prefill's last position first)
        assert torch.equal(prev_h, result.hidden[step - 1])
        # emb: the input embedding row of the token this step feeds (output token ``step``)
        assert torch.equal(emb, ref.model.get_input_embeddings().weight[result.tokens[step - 1]].float())
        # local_h feeds the LM head: on a Local step it is what was committed and projected
        if not result.full_steps[step - 1]:
            assert torch.equal(local_h, result.hidden[step])
    # the prefill's hidden is the final-norm output: the LM head maps it to the first token
    assert int(ref.model.lm_head(result.hidden[0]).argmax()) == result.tokens[0]


def test_head_route_sends_non_finite_scores_to_full(refs):
    ref = refs["tiny-hybrid-deep"]

    class NaNHead:
        def __call__(self, prev_h, emb, local_h):
            return torch.full(prev_h.shape[:-1], float("nan"))

    scores: list[float] = []
    result = oda.oda_generate(ref, prompt(ref), 4, SINKS, WINDOW, oda.head_route(NaNHead(), 0.0, scores))
    assert result.full_steps == [True, True, True] and len(scores) == 3
