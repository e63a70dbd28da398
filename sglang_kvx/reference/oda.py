"""The On-Demand Attention oracle in HF transformers (seed 003, Algorithm 1 (b), appendix A.5).

Greedy decoding where every routed step first runs Local attention (the first ``sinks`` keys and
the ``window`` most recent, the current one included; the rest of the retained cache is masked
with HF's own attention mask exactly as ``HFReference.span_generate`` does), asks
``route(step, prev_h, emb, local_h)`` whether to re-run the step with Full attention, and if so
restores the pre-step cache (a deep copy taken before the Local attempt: KV, and on hybrid models
the GDN recurrent and conv states) and runs Full. Only the chosen branch's logits, final hidden
state and cache are committed; the full KV history is always kept.

Steps are numbered as in ``sglang_kvx.decode.base``: the prefill (Full) produces output token 1;
routed step t feeds output token t, so N outputs take N - 1 routed steps. Route inputs (``[hidden]``
float32 tensors) are the ones ``sglang_kvx.decode.recall_head`` documents: ``prev_h`` the committed
final hidden state of the previous step (the prefill's last position for step 1), ``emb`` the
current token's input embedding row, ``local_h`` the Local attempt's final hidden state (after the
final norm, the LM head's input).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sglang_kvx.decode.base import Span
from sglang_kvx.reference.hf import HFReference, take_greedy

Route = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], bool]


@dataclass
class ODAResult:
    tokens: list[int]
    logprobs: list[float]
    full_steps: list[bool]  # per routed step (len(tokens) - 1): True where Full was committed
    hidden: list[torch.Tensor] = field(default_factory=list)  # committed final hidden, prefill's first

    @property
    def full_rate(self) -> float:
        return sum(self.full_steps) / len(self.full_steps) if self.full_steps else 0.0


def _hf_model(model: Any):
    return model.model if isinstance(model, HFReference) else model


def span_mask(seq_len: int, sinks: int, window: int | None) -> torch.Tensor:
    """HF's 2-D attention mask [1, seq_len] for a step reading ``seq_len`` keys (its own included):
    ones on the first ``sinks`` and the last ``window`` keys, zeros between (all ones for Full)."""
    mask = torch.ones(1, seq_len, dtype=torch.long)
    start, end = Span(sinks, window).hidden(seq_len)
    mask[0, start:end] = 0
    return mask


@torch.no_grad()
def forward_step(model: Any, cache: Any, token: int, seq_len: int, sinks: int = 0,
                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One one-token forward of ``token`` at position ``seq_len - 1`` over ``cache`` (updated in
    place: its KV appended, recurrent states advanced), attending to the span (sinks, window)
    (``window`` None: Full). Returns (final hidden [hidden] after the final norm, logits [vocab])."""
    lm = _hf_model(model)
    position = torch.tensor([[seq_len - 1]])
    out = lm.model(torch.tensor([[token]]), attention_mask=span_mask(seq_len, sinks, window), position_ids=position,
                   cache_position=position[0], past_key_values=cache, use_cache=True)
    hidden = out.last_hidden_state[0, -1]
    return hidden.float(), lm.lm_head(hidden).float()


@torch.no_grad()
def prefill(model: Any, input_ids: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Full prefill: (cache, last position's final hidden [hidden], its logits [vocab])."""
    lm = _hf_model(model)
    out = lm.model(torch.tensor([input_ids]), use_cache=True)
    hidden = out.last_hidden_state[0, -1]
    return out.past_key_values, hidden.float(), lm.lm_head(hidden).float()


def embed(model: Any, token: int) -> torch.Tensor:
    """The model's input embedding row of ``token`` (embed_tokens(token)), float32 [hidden]."""
    return _hf_model(model).get_input_embeddings().weight[token].detach().float()


@torch.no_grad()
def oda_generate(model: HFReference | Any, input_ids: list[int], max_new_tokens: int, sinks: int, window: int,
                 route: Route, keep_hidden: bool = False, stop_token: int | None = None) -> ODAResult:
    """Greedy ODA decoding. ``model``: an HFReference or an HF causal LM.
    ``route(step, prev_h, emb, local_h) -> bool`` (True: re-run the step with Full). Stops after
    ``stop_token`` (the EOS a server stops at) when given, else after ``max_new_tokens``."""
    cache, prev_h, logits = prefill(model, input_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    full_steps: list[bool] = []
    hidden = [prev_h] if keep_hidden else []
    while True:
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        if len(tokens) == max_new_tokens or token == stop_token:
            break
        step, seq_len = len(tokens), len(input_ids) + len(tokens)
        pre_step = copy.deepcopy(cache)  # KV and GDN / conv states before this step
        local_h, local_logits = forward_step(model, cache, token, seq_len, sinks, window)
        full = bool(route(step, prev_h, embed(model, token), local_h))
        if full:
            cache = pre_step  # the Local attempt is discarded: nothing of it is committed
            prev_h, logits = forward_step(model, cache, token, seq_len)
        else:
            prev_h, logits = local_h, local_logits
        full_steps.append(full)
        if keep_hidden:
            hidden.append(prev_h)
    return ODAResult(tokens, logprobs, full_steps, hidden)


# --- fixed schedules and the learned head, as routes -------------------------------------------

def always_local(step: int, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor) -> bool:
    return False


def always_full(step: int, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor) -> bool:
    return True


def every_kth(k: int) -> Route:
    """Full on steps k, 2k, ... (``span_schedule``'s ``full_every`` rule)."""
    return lambda step, prev_h, emb, local_h: step % k == 0


def head_route(head: Any, theta: float = 0.0, scores: list[float] | None = None) -> Route:
    """The learned rule: Full iff head(prev_h, emb, local_h) > theta or the score is not finite.
    Appends each score to ``scores`` when given."""
    def route(step: int, prev_h: torch.Tensor, emb: torch.Tensor, local_h: torch.Tensor) -> bool:
        score = float(head(prev_h[None], emb[None], local_h[None])[0])
        if scores is not None:
            scores.append(score)
        return not (score <= theta)  # NaN compares False: a non-finite score takes Full
    return route


# --- paired supervision (training, A.3) ---------------------------------------------------------

def _croppable(cache: Any) -> bool:
    """Whether every layer is plain KV (a dense model): then dropping the Local attempt's entry
    restores the pre-step cache, with no copy of the whole history."""
    return all(not hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", [None]))


@torch.no_grad()
def paired_step(model: Any, cache: Any, token: int, seq_len: int, sinks: int, window: int,
                keep_local: Callable[[torch.Tensor], bool] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """Both counterfactuals of one step from the same pre-step ``cache``: Local, then Full from
    the restored pre-step state. Full is committed (the Full trunk goes on) unless
    ``keep_local(local_h)`` returns True: then the Local branch is, as a route would have it.
    Returns (local_h, local_logits, full_h, full_logits, cache after the committed step)."""
    if _croppable(cache):
        local_h, local_logits = forward_step(model, cache, token, seq_len, sinks, window)
        cache.crop(seq_len - 1)
        full_h, full_logits = forward_step(model, cache, token, seq_len)
        if keep_local is not None and keep_local(local_h):
            cache.crop(seq_len - 1)
            forward_step(model, cache, token, seq_len, sinks, window)  # Local's entry again: same ops, same values
        return local_h, local_logits, full_h, full_logits, cache
    pre_step = copy.deepcopy(cache)
    local_h, local_logits = forward_step(model, cache, token, seq_len, sinks, window)
    local_cache, cache = cache, pre_step
    full_h, full_logits = forward_step(model, cache, token, seq_len)
    if keep_local is not None and keep_local(local_h):
        cache = local_cache
    return local_h, local_logits, full_h, full_logits, cache


# --- the per-step oracle route (perf/bench_oda_oracle.py) ----------------------------------------

@dataclass
class PairedResult(ODAResult):
    """An ODAResult whose every routed step ran both branches from the same pre-step state."""
    local_tokens: list[int] = field(default_factory=list)  # per routed step: Local's argmax
    full_tokens: list[int] = field(default_factory=list)  # per routed step: Full's argmax

    @property
    def disagree(self) -> list[bool]:
        """Per routed step: True where Local's argmax differs from Full's (the step needs Full)."""
        return [a != b for a, b in zip(self.local_tokens, self.full_tokens)]


@torch.no_grad()
def oracle_generate(model: HFReference | Any, input_ids: list[int], max_new_tokens: int, sinks: int, window: int,
                    commit: str = "oracle", stop_ids: tuple[int, ...] | set[int] = ()) -> PairedResult:
    """Greedy decoding that runs every routed step under Local and under Full from the same
    pre-step state (as ``paired_step``) and commits (logits and cache) the branch ``commit``
    names: ``"oracle"`` Local's where its argmax token equals Full's, else Full's (the cheapest
    route that reproduces Full's greedy choice at every step, from its own state); ``"full"``
    always Full (the Full trajectory, Local's counterfactual recorded beside it).
    Stops after ``max_new_tokens`` outputs or after an output in ``stop_ids`` (kept in ``tokens``,
    as the server's EOS stop keeps it); ``full_steps`` marks the committed branch per routed step;
    ``hidden`` is not kept."""
    if commit not in ("oracle", "full"):
        raise ValueError(f"commit must be 'oracle' or 'full', not {commit!r}")
    cache, _, logits = prefill(model, input_ids)
    result = PairedResult([], [], [])
    while True:
        token = int(logits.argmax())
        result.tokens.append(token)
        result.logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        if len(result.tokens) == max_new_tokens or token in stop_ids:
            return result
        seq_len = len(input_ids) + len(result.tokens)
        full_cache = copy.deepcopy(cache)  # the pre-step state, for the Full branch
        _, local_logits = forward_step(model, cache, token, seq_len, sinks, window)
        _, full_logits = forward_step(model, full_cache, token, seq_len)
        local_token, full_token = int(local_logits.argmax()), int(full_logits.argmax())
        result.local_tokens.append(local_token)
        result.full_tokens.append(full_token)
        full = commit == "full" or local_token != full_token
        cache, logits = (full_cache, full_logits) if full else (cache, local_logits)
        result.full_steps.append(full)


# --- local-first decoding over a compacted prefix (tests/test_oda_e2e.py) ------------------------

@torch.no_grad()
def compacted_route_generate(
    ref: HFReference, context_ids: list[int], keep: list[torch.Tensor], question_ids: list[int], max_new_tokens: int,
    sinks: int, window: int, route: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], bool],
) -> tuple[list[int], list[float], list[bool]]:
    """``HFReference.compacted_generate`` with local-first decoding (On-Demand Attention over a compacted
    prefix): each decode step t first reads, in every attention layer, the first ``sinks`` and
    the ``window`` most recent of that layer's keys (its K_l kept entries, then the question and
    the answer so far); ``route(t, prev_h, emb, local_h)`` True re-runs it with all of them from
    a copy of the pre-step cache. Returns tokens, log-probs and per step whether Full was kept."""
    model = ref.model
    cache, valid = ref.compacted_cache(context_ids, keep)
    if valid:
        raise NotImplementedError("local-first decoding over per-head budgets (the server refuses it too)")

    def forward(ids: list[int], position: int, cache, span=None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(position, position + len(ids))[None]
        extra = {} if span is None else {"kvx_local_span": span}
        hidden = model.model(torch.tensor([ids]), position_ids=positions, cache_position=positions[0],
                             past_key_values=cache, use_cache=True, **extra).last_hidden_state[0, -1]
        return hidden.float(), model.lm_head(hidden).float()

    with ref.oracle_attention():
        position = len(context_ids)
        prev_h, logits = forward(list(question_ids), position, cache)
        position += len(question_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        full_steps: list[bool] = []
        while True:
            if take_greedy(logits, tokens, logprobs) == max_new_tokens:
                break
            pre_step = copy.deepcopy(cache)
            local_h, local_logits = forward(tokens[-1:], position, cache, (sinks, window))
            emb = model.get_input_embeddings().weight[tokens[-1]].float()
            full = bool(route(len(tokens), prev_h, emb, local_h))
            if full:
                cache = pre_step
                prev_h, logits = forward(tokens[-1:], position, cache)
            else:
                prev_h, logits = local_h, local_logits
            full_steps.append(full)
            position += 1
        return tokens, logprobs, full_steps
