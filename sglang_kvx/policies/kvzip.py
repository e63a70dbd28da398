"""``kvzip``: keep the entries the model reads when asked to repeat the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (NeurIPS
2025, arXiv:2505.23416; github.com/snu-mllab/KVzip). After the context is prefilled, a second pass
teacher-forces its reconstruction on top of the cache: the input is the prompt "\\n\\nRepeat the
previous context exactly.", the chat template's assistant header, then the context tokens. An
entry's score is the max, over that pass's queries and over the query heads of its KV group, of
the softmax attention it receives; the softmax runs over the cached keys and the pass's own
(causal) keys. Long contexts are reconstructed in chunks of 2000 tokens; chunk c > 0 is prompted
"\\n\\nRepeat the part of the previous context exactly, starting with " plus the last 8 tokens
of chunk c-1, and its scoring softmax covers the protected prefix (KVzip's system prompt), the
chunk and the pass's own keys. These are the KVzip repo's defaults (model/wrapper.py, attention/score.py).

The score itself is ContextSignals.reconstruction_attention; ``accumulate_reconstruction_attention``
turns one pass's captured queries and keys into it, ``reconstruction_inputs`` builds the passes
from the ids ``reconstruction_prompt_ids`` takes from the model's tokenizer.

Budgets: the paper's non-uniform head budgets, one threshold over every layer and KV head (the
``global`` allocation, this policy's default): a head the reconstruction reads much keeps much.
The context then folds over (layer, KV head) cells (``compact/layout.fold_heads``) and frees
exactly 1 - p of its entries past the protected prefix. Kept flat instead (``allocation: "flat"``,
round(p * m) per layer and KV head, which tensor parallelism, pages and block-sparse attention
still need), the same scores lose most of their quality on a pretrained model: on
SmolLM2-135M-Instruct (issue #42's 12 prompts, ``perf/kvzip_allocation.py``) flat scores 33.3 at
p = 0.5 / 0.2 / 0.1 where one threshold scores 72.9 / 64.6 / 56.2, kvpress's own figures.

Against kvpress's KVzipPress (same max-over-queries-and-group score and the same global threshold
with layerwise=False): kvpress pins the first ``n_sink`` = 4 tokens (score 1); here they score +inf,
the same effect, on top of the protected prefix. kvpress keeps int(p * n) of the whole context
including the sinks, here round(p * m) per head on average past the protected prefix; kvpress
reconstructs in chunks of 2048, here the KVzip repo's 2000.
"""

from __future__ import annotations

import math

import torch

from sglang_kvx.policies.base import KVPolicy, SecondPass, layer_signal, register_policy
from sglang_kvx.signals import ContextSignals

RECONSTRUCTION_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUATION_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "
CHUNK_SIZE = 2000
PREVIOUS_TAIL = 8
# KVzip's postfix for a model without a chat template (its model/template.py fallback).
PLAIN_POSTFIX = "\n\nAnswer: "
_SENTINEL = "KVXRECONSTRUCTIONSENTINEL"
_QUERY_BLOCK = 512


def reconstruction_prompt_ids(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(prompt, continuation prompt, postfix) token ids: KVzip's two prompts, then the chat template's
    end of user turn and assistant header (non-thinking), or KVzip's plain "\\n\\nAnswer: "."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    postfix = PLAIN_POSTFIX
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        if _SENTINEL in rendered:
            postfix = rendered.split(_SENTINEL, 1)[1]
    return encode(RECONSTRUCTION_PROMPT), encode(CONTINUATION_PROMPT), encode(postfix)


def reconstruction_inputs(
    context_ids: list[int],
    prompt_ids: list[int],
    continuation_ids: list[int],
    postfix_ids: list[int],
    *,
    protected_prefix_len: int = 0,
    chunk_size: int = CHUNK_SIZE,
    previous_tail: int = PREVIOUS_TAIL,
) -> list[tuple[int, int, list[int]]]:
    """The reconstruction passes: (start, end, input ids) for each chunk [start, end) of the context after the prefix.

    Each pass runs on top of the full cached context (positions n, n + 1, ...) and leaves the cache as it was.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = len(context_ids)
    passes = []
    for start in range(protected_prefix_len, n, chunk_size):
        end = min(start + chunk_size, n)
        if start == protected_prefix_len:
            lead = list(prompt_ids)
        else:
            lead = list(continuation_ids) + list(context_ids[max(protected_prefix_len, start - previous_tail) : start])
        passes.append((start, end, lead + list(postfix_ids) + list(context_ids[start:end])))
    return passes


def accumulate_reconstruction_attention(
    total: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    start: int,
    end: int,
    *,
    protected_prefix_len: int = 0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Fold one reconstruction pass of one attention layer into ``total`` [kv_heads, n] (running max, in place).

    queries [q_heads, q, head_dim]: the pass's post-RoPE queries; keys [kv_heads, n + q, head_dim]:
    the n cached context keys followed by the pass's own q keys. Every query sees the protected
    prefix [0, p), the chunk [start, end) and the pass's keys up to itself; the softmax (scale
    ``scaling``, default 1/sqrt(head_dim)) runs over exactly those, and the chunk's and the prefix's
    columns update ``total`` with their max over queries and over the heads of each KV group.
    Start ``total`` at zeros (every softmax weight is >= 0).
    """
    num_q_heads, q_len, head_dim = queries.shape
    num_kv_heads, n_plus_q, _ = keys.shape
    n = n_plus_q - q_len
    if not 0 <= protected_prefix_len <= start <= end <= n:
        raise ValueError(f"chunk [{start}, {end}) with prefix {protected_prefix_len} does not fit {n} context entries")
    if total.shape != (num_kv_heads, n):
        raise ValueError(f"total must be [{num_kv_heads}, {n}], got {tuple(total.shape)}")
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else scaling
    group = num_q_heads // num_kv_heads
    prefix, chunk = protected_prefix_len, end - start
    columns = torch.cat([torch.arange(prefix), torch.arange(start, end), torch.arange(n, n_plus_q)]).to(keys.device)
    own = torch.arange(q_len, device=keys.device)
    for kv_head in range(num_kv_heads):
        visible_keys = keys[kv_head, columns].float()  # [prefix + chunk + q, D]
        best = torch.zeros(prefix + chunk, device=keys.device)
        for q_start in range(0, q_len, _QUERY_BLOCK):
            q_end = min(q_start + _QUERY_BLOCK, q_len)
            block = queries[kv_head * group : (kv_head + 1) * group, q_start:q_end].float()  # [group, b, D]
            logits = block @ visible_keys.T * scaling  # [group, b, prefix + chunk + q]
            future = own[None, :] > own[q_start:q_end, None]  # the pass's own later keys
            logits[..., prefix + chunk :] = logits[..., prefix + chunk :].masked_fill(future, float("-inf"))
            probs = logits.softmax(dim=-1)[..., : prefix + chunk]
            best = torch.maximum(best, probs.amax(dim=(0, 1)))
        total[kv_head, :prefix] = torch.maximum(total[kv_head, :prefix], best[:prefix])
        total[kv_head, start:end] = torch.maximum(total[kv_head, start:end], best[prefix:])
    return total


class KVzipReconstruction(SecondPass):
    """KVzip's second pass: the context repeated after its repeat prompt, chunk by chunk, each chunk's
    score the max over the pass's queries (and a KV group's heads) of the attention they pay it."""

    signal = "reconstruction_attention"

    def prompt_ids(self, tokenizer) -> tuple[list[int], list[int], list[int]]:
        return reconstruction_prompt_ids(tokenizer)

    def passes(self, context_ids: list[int], prompt, protected_prefix_len: int) -> list[tuple[int, int, list[int]]]:
        return reconstruction_inputs(context_ids, *prompt, protected_prefix_len=protected_prefix_len)

    def longest_pass(self, n: int, prompt, protected_prefix_len: int) -> int:
        first, continuation, postfix = prompt
        chunk = min(CHUNK_SIZE, max(0, n - protected_prefix_len))
        return max(len(first), len(continuation) + PREVIOUS_TAIL) + len(postfix) + chunk

    def accumulate(self, total, queries, keys, start, end, *, protected_prefix_len, scaling) -> None:
        accumulate_reconstruction_attention(total, queries, keys, start, end,
                                            protected_prefix_len=protected_prefix_len, scaling=scaling)


@register_policy("kvzip")
class KVzipPolicy(KVPolicy):
    needs = frozenset({"reconstruction"})
    second_pass = KVzipReconstruction()
    allocation = "global"
    # Under --tp-size > 1 every rank queues the same reconstruction passes at the same point (the ranks
    # release the same parent in lockstep), so their schedulers stay identical (with allocation 'flat').

    def __init__(self, *, n_sink: int = 4) -> None:
        if n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {n_sink}")
        self.n_sink = n_sink

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        scores = layer_signal(signals, "reconstruction_attention", layer, self.name).float().clone()
        scores[:, : self.n_sink] = float("inf")  # kvpress's sinks: always kept
        return scores
