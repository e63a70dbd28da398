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


def test_stop_token_ends_like_a_server_at_eos(refs):
    """With a stop token the oracle ends right after emitting it, as a server stops at EOS, and
    routes no step past it (the closed-loop Full rates are counted over these steps)."""
    ref = refs["tiny-llama"]
    ids = prompt(ref)
    whole = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.every_kth(2))
    stop = whole.tokens[5]
    end = whole.tokens.index(stop) + 1
    cut = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.every_kth(2), stop_token=stop)
    assert cut.tokens == whole.tokens[:end] and cut.logprobs == whole.logprobs[:end]
    assert cut.full_steps == whole.full_steps[:end - 1]


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

# --- the per-step oracle route (``oda.oracle_generate``, perf/bench_oda_oracle.py): at every routed
# step it commits Local exactly where Local's argmax equals Full's from the same state, else Full,
# checked against decoders that share none of its code path (``span_generate`` with a per-step span
# rule, ``greedy``). A window of 16 over the 160-token prompt: on both models some steps agree and
# some do not (tiny-llama: Full on 10 of 11 steps, tiny-hybrid-deep: on 1 of 11), so both branches
# get committed.
ORACLE_WINDOW = 16
ORACLE_LOCAL, FULL_SPAN = (SINKS, ORACLE_WINDOW), (0, None)


def next_token(ref: HFReference, ids: list[int], schedule: list[bool], last: tuple[int, int | None]) -> int:
    """Output token len(schedule) + 2: steps 1..len(schedule) run Full where ``schedule`` says,
    else Local, then the next step runs with span ``last``."""
    spans = [FULL_SPAN if full else ORACLE_LOCAL for full in schedule] + [last]
    tokens, _ = ref.span_generate(ids, len(spans) + 1, lambda step: spans[step - 1])
    return tokens[-1]


@pytest.mark.parametrize("name", MODELS)
def test_oracle_commits_local_exactly_where_local_agrees_with_full(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW)
    assert len(result.full_steps) == NEW - 1 and 0 < result.full_rate < 1  # both branches were committed
    # the committed tokens are what a decoder running exactly that schedule produces
    tokens, logprobs = ref.span_generate(ids, NEW, lambda step: FULL_SPAN if result.full_steps[step - 1] else ORACLE_LOCAL)
    assert result.tokens == tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) <= 1e-5
    # and the schedule is the oracle's: at each step, from the committed prefix, the output is what
    # Full would choose, and Local was kept exactly where Local would have chosen the same token
    for step in range(1, NEW):
        prefix = result.full_steps[:step - 1]
        with_full = next_token(ref, ids, prefix, FULL_SPAN)
        with_local = next_token(ref, ids, prefix, ORACLE_LOCAL)
        assert result.tokens[step] == with_full, step
        assert result.full_steps[step - 1] == (with_local != with_full), step
        assert (result.local_tokens[step - 1], result.full_tokens[step - 1]) == (with_local, with_full), step


@pytest.mark.parametrize("name", MODELS)
def test_oracle_follows_full_greedy_through_the_first_disagreement(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW)
    greedy = ref.greedy(ids, NEW)
    first = result.full_steps.index(True) + 1  # the first step where Local and Full disagree
    assert result.tokens[:first + 1] == greedy[:first + 1]
    # committing Local at that step would have left Full's greedy path: the case can tell the branches apart
    wrong = next_token(ref, ids, result.full_steps[:first - 1], ORACLE_LOCAL)
    assert wrong != greedy[first]


@pytest.mark.parametrize("name", MODELS)
def test_full_commit_is_full_greedy_with_local_counterfactuals(refs, name):
    ref = refs[name]
    ids = prompt(ref, seed=1)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW, commit="full")
    reference = oda.oda_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW, oda.always_full)
    assert result.tokens == reference.tokens and result.full_steps == [True] * (NEW - 1)
    assert result.full_tokens == reference.tokens[1:]
    for step in range(1, NEW):
        assert result.local_tokens[step - 1] == next_token(ref, ids, [True] * (step - 1), ORACLE_LOCAL), step
    assert result.disagree == [a != b for a, b in zip(result.local_tokens, reference.tokens[1:])]


def test_stop_token_ends_generation_and_is_kept(refs):
    ref = refs["tiny-hybrid-deep"]
    ids = prompt(ref)
    full = oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW)
    stop = full.tokens[5]
    end = full.tokens.index(stop) + 1
    result = oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW, stop_ids={stop})
    assert result.tokens == full.tokens[:end]
    assert result.full_steps == full.full_steps[:end - 1]  # N outputs, N - 1 routed steps
    with pytest.raises(ValueError):
        oda.oracle_generate(ref, ids, NEW, SINKS, ORACLE_WINDOW, commit="local")
