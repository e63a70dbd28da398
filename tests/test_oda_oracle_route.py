"""The per-step oracle route (``oda.oracle_generate``, perf/bench_oda_oracle.py) on the dense and the
hybrid demo models: at every routed step it commits Local exactly where Local's argmax equals Full's
from the same state, else Full, checked against decoders that share none of its code path
(``HFReference.span_generate`` with a per-step span rule, ``HFReference.greedy``)."""

from __future__ import annotations

import pytest
import torch

from sglang_kvx.reference import oda
from sglang_kvx.reference.hf import HFReference

MODELS = ("tiny-llama", "tiny-hybrid-deep")
# A window of 16 over a 160-token prompt: on both models some steps agree and some do not
# (tiny-llama: Full on 10 of 11 steps, tiny-hybrid-deep: on 1 of 11), so both branches get committed.
SINKS, WINDOW, NEW = 4, 16, 12
LOCAL, FULL = (SINKS, WINDOW), (0, None)


@pytest.fixture(scope="module")
def refs() -> dict[str, HFReference]:
    return {name: HFReference(f"weights/{name}") for name in MODELS}


def prompt(ref: HFReference, n: int = 160, seed: int = 0) -> list[int]:
    vocab = ref.model.config.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def next_token(ref: HFReference, ids: list[int], schedule: list[bool], last: tuple[int, int | None]) -> int:
    """Output token len(schedule) + 2: steps 1..len(schedule) run Full where ``schedule`` says,
    else Local, then the next step runs with span ``last``."""
    spans = [FULL if full else LOCAL for full in schedule] + [last]
    tokens, _ = ref.span_generate(ids, len(spans) + 1, lambda step: spans[step - 1])
    return tokens[-1]


@pytest.mark.parametrize("name", MODELS)
def test_oracle_commits_local_exactly_where_local_agrees_with_full(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW)
    assert len(result.full_steps) == NEW - 1 and 0 < result.full_rate < 1  # both branches were committed
    # the committed tokens are what a decoder running exactly that schedule produces
    tokens, logprobs = ref.span_generate(ids, NEW, lambda step: FULL if result.full_steps[step - 1] else LOCAL)
    assert result.tokens == tokens
    assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) <= 1e-5
    # and the schedule is the oracle's: at each step, from the committed prefix, the output is what
    # Full would choose, and Local was kept exactly where Local would have chosen the same token
    for step in range(1, NEW):
        prefix = result.full_steps[:step - 1]
        with_full = next_token(ref, ids, prefix, FULL)
        with_local = next_token(ref, ids, prefix, LOCAL)
        assert result.tokens[step] == with_full, step
        assert result.full_steps[step - 1] == (with_local != with_full), step
        assert (result.local_tokens[step - 1], result.full_tokens[step - 1]) == (with_local, with_full), step


@pytest.mark.parametrize("name", MODELS)
def test_oracle_follows_full_greedy_through_the_first_disagreement(refs, name):
    ref = refs[name]
    ids = prompt(ref)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW)
    greedy = ref.greedy(ids, NEW)
    first = result.full_steps.index(True) + 1  # the first step where Local and Full disagree
    assert result.tokens[:first + 1] == greedy[:first + 1]
    # committing Local at that step would have left Full's greedy path: the case can tell the branches apart
    wrong = next_token(ref, ids, result.full_steps[:first - 1], LOCAL)
    assert wrong != greedy[first]


@pytest.mark.parametrize("name", MODELS)
def test_full_commit_is_full_greedy_with_local_counterfactuals(refs, name):
    ref = refs[name]
    ids = prompt(ref, seed=1)
    result = oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW, commit="full")
    reference = oda.oda_generate(ref, ids, NEW, SINKS, WINDOW, oda.always_full)
    assert result.tokens == reference.tokens and result.full_steps == [True] * (NEW - 1)
    assert result.full_tokens == reference.tokens[1:]
    for step in range(1, NEW):
        assert result.local_tokens[step - 1] == next_token(ref, ids, [True] * (step - 1), LOCAL), step
    assert result.disagree == [a != b for a, b in zip(result.local_tokens, reference.tokens[1:])]


def test_stop_token_ends_generation_and_is_kept(refs):
    ref = refs["tiny-hybrid-deep"]
    ids = prompt(ref)
    full = oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW)
    stop = full.tokens[5]
    end = full.tokens.index(stop) + 1
    result = oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW, stop_ids={stop})
    assert result.tokens == full.tokens[:end]
    assert result.full_steps == full.full_steps[:end - 1]  # N outputs, N - 1 routed steps
    with pytest.raises(ValueError):
        oda.oracle_generate(ref, ids, NEW, SINKS, WINDOW, commit="local")
