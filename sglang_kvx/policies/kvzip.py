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

KVzip+ (``kvzip_plus``; Jegou & Jeblick, "KVzap", arXiv:2601.07891, Eq. 3): the same passes, each
attention weight a_ji from pass query j to entry i weighted by what the entry writes into the
residual stream against what the query reads from it, s_i = max_j a_ji * ||W_O^h v_i|| / ||h_j||:
W_O^h is query head h's slice of the output projection, v_i the entry's value, h_j the query token's
hidden state at the attention's input (after ``input_layernorm``, as kvpress's code takes it); per
query head, then the max over the heads of each KV group. The max runs over the queries of the
repeated context only (the paper's Eq. 1 and 3, kvpress's ``kvzap/data.py``), not over the repeat
prompt's. kvpress's ``KVzipPress(kvzip_plus_normalization=True)`` maxes over every query of its
repeat chunk, prompt included; otherwise the same normalisation. ||W_O^h v_i|| comes from the
checkpoint's ``o_proj`` weights (read once, as per-head Gram matrices W_O^h^T W_O^h), ||h_j|| from
the hidden-state signal each pass records (``signals/hidden_states.py``); under tensor parallelism
each rank weights its own query heads by their slices of ``o_proj``. These scores, in log, are what
the KVzap surrogates learn (``policies/kvzap.py``).

Against kvpress's KVzipPress (same max-over-queries-and-group score and the same global threshold
with layerwise=False): kvpress pins the first ``n_sink`` = 4 tokens (score 1); here they score +inf,
the same effect, on top of the protected prefix. kvpress keeps int(p * n) of the whole context
including the sinks, here round(p * m) per head on average past the protected prefix; kvpress
reconstructs in chunks of 2048, here the KVzip repo's 2000.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import ClassVar

import torch

from sglang_kvx.policies.base import KVPolicy, PassLayer, SecondPass, layer_signal, register_policy
from sglang_kvx.signals import CaptureSpec, ContextSignals

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
    plus: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Fold one reconstruction pass of one attention layer into ``total`` [kv_heads, n] (running max, in place).

    queries [q_heads, q, head_dim]: the pass's post-RoPE queries; keys [kv_heads, n + q, head_dim]:
    the n cached context keys followed by the pass's own q keys. Every query sees the protected
    prefix [0, p), the chunk [start, end) and the pass's keys up to itself; the softmax (scale
    ``scaling``, default 1/sqrt(head_dim)) runs over exactly those, and the chunk's and the prefix's
    columns update ``total`` with their max over queries and over the heads of each KV group.
    Start ``total`` at zeros (every softmax weight is >= 0).

    ``plus`` = (value_norms [q_heads, n], hidden_norms [q]): KVzip+, each weight times the entry's
    ||W_O^h v_i|| over the query's ||h_j||, and only the last ``end - start`` queries (the repeated
    chunk itself) count in the max.
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
    context_columns = torch.cat([torch.arange(prefix), torch.arange(start, end)]).to(keys.device)
    columns = torch.cat([context_columns, torch.arange(n, n_plus_q, device=keys.device)])
    own = torch.arange(q_len, device=keys.device)
    first = 0
    if plus is not None:
        value_norms, hidden_norms = plus
        if value_norms.shape != (num_q_heads, n) or hidden_norms.shape != (q_len,):
            raise ValueError(f"KVzip+ needs value norms [{num_q_heads}, {n}] and hidden norms [{q_len}], got "
                             f"{tuple(value_norms.shape)} and {tuple(hidden_norms.shape)}")
        first = max(0, q_len - chunk)  # the repeated chunk's own queries; the prompt before it does not count
        weight_of_entry = value_norms[:, context_columns].float()  # [Hq, prefix + chunk]
        inverse_query_norm = 1.0 / hidden_norms.float()
    for kv_head in range(num_kv_heads):
        heads = slice(kv_head * group, (kv_head + 1) * group)
        visible_keys = keys[kv_head, columns].float()  # [prefix + chunk + q, D]
        best = torch.zeros(prefix + chunk, device=keys.device)
        for q_start in range(first, q_len, _QUERY_BLOCK):
            q_end = min(q_start + _QUERY_BLOCK, q_len)
            block = queries[heads, q_start:q_end].float()  # [group, b, D]
            logits = block @ visible_keys.T * scaling  # [group, b, prefix + chunk + q]
            future = own[None, :] > own[q_start:q_end, None]  # the pass's own later keys
            logits[..., prefix + chunk :] = logits[..., prefix + chunk :].masked_fill(future, float("-inf"))
            probs = logits.softmax(dim=-1)[..., : prefix + chunk]
            if plus is not None:
                probs = probs * weight_of_entry[heads, None, :] * inverse_query_norm[q_start:q_end, None]
            best = torch.maximum(best, probs.amax(dim=(0, 1)))
        total[kv_head, :prefix] = torch.maximum(total[kv_head, :prefix], best[:prefix])
        total[kv_head, start:end] = torch.maximum(total[kv_head, start:end], best[prefix:])
    return total


_O_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.o_proj\.weight$")


class OutputProjections:
    """Per attention layer and query head, W_O^h^T W_O^h [D, D] of the checkpoint's ``o_proj``: then
    ||W_O^h v|| = sqrt(v^T G_h v), D x D work per entry instead of D x hidden. Read from the
    checkpoint's safetensors once, on first use (every layer's ``self_attn.o_proj``, in layer order:
    the attention layers of a hybrid model)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = Path(model_path)
        self._grams: list[torch.Tensor] | None = None

    def _load(self, head_dim: int) -> list[torch.Tensor]:
        from safetensors import safe_open

        weights: dict[int, torch.Tensor] = {}
        for file in sorted(self.model_path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if (match := _O_PROJ.search(name)) is not None:
                        weights[int(match.group(1))] = f.get_tensor(name).float()
        if not weights:
            raise FileNotFoundError(f"{self.model_path}: no self_attn.o_proj weights in its safetensors (KVzip+ reads them)")
        grams = []
        for layer_id in sorted(weights):
            w = weights[layer_id].reshape(weights[layer_id].shape[0], -1, head_dim).transpose(0, 1)  # [Hq, hidden, D]
            grams.append(w.transpose(1, 2) @ w)  # [Hq, D, D]
        return grams

    def value_norms(self, layer: int, values: torch.Tensor, num_q_heads: int, first_q_head: int = 0) -> torch.Tensor:
        """||W_O^h v_i|| for query head h and entry i: [q_heads, n] from values [kv_heads, n, D]; the
        query heads are the model's [first_q_head, first_q_head + num_q_heads) (a tensor-parallel rank's)."""
        if self._grams is None:
            self._grams = self._load(values.shape[-1])
        gram = self._grams[layer][first_q_head : first_q_head + num_q_heads].to(values.device)  # [Hq, D, D]
        v = values.float().repeat_interleave(num_q_heads // values.shape[0], dim=0)  # [Hq, n, D]
        return torch.einsum("hnd,hde,hne->hn", v, gram, v).clamp_min(0).sqrt()


class KVzipReconstruction(SecondPass):
    """KVzip's second pass: the context repeated after its repeat prompt, chunk by chunk, each chunk's
    score the max over the pass's queries (and a KV group's heads) of the attention they pay it.
    With ``plus`` (the checkpoint's output projections) the KVzip+ score: each pass also records its
    tokens' hidden-state norms."""

    signal = "reconstruction_attention"

    def __init__(self, plus: OutputProjections | bool = False) -> None:
        self.plus = plus

    def capture(self) -> CaptureSpec:
        if self.plus:  # ||h_j|| of every pass token: norms only (option 1), not the vectors
            return CaptureSpec(pass_queries=True, hidden_states=1)
        return CaptureSpec(pass_queries=True)

    def prompt_ids(self, tokenizer) -> tuple[list[int], list[int], list[int]]:
        return reconstruction_prompt_ids(tokenizer)

    def passes(self, context_ids: list[int], prompt, protected_prefix_len: int) -> list[tuple[int, int, list[int]]]:
        return reconstruction_inputs(context_ids, *prompt, protected_prefix_len=protected_prefix_len)

    def longest_pass(self, n: int, prompt, protected_prefix_len: int) -> int:
        first, continuation, postfix = prompt
        chunk = min(CHUNK_SIZE, max(0, n - protected_prefix_len))
        return max(len(first), len(continuation) + PREVIOUS_TAIL) + len(postfix) + chunk

    def accumulate(self, total: torch.Tensor, layer: PassLayer, start: int, end: int, *, protected_prefix_len: int) -> None:
        plus = None
        if self.plus:
            if not isinstance(self.plus, OutputProjections):
                raise ValueError("kvzip_plus needs the model's output projections: build the policy with model_path")
            n, num_q_heads = total.shape[1], layer.queries.shape[0]
            first = (layer.kv_heads[0] if layer.kv_heads else 0) * (num_q_heads // total.shape[0])
            value_norms = self.plus.value_norms(layer.layer, layer.values()[:, :n], num_q_heads, first)
            plus = (value_norms, layer.recording.state("hidden_states").norms(layer.layer))
        accumulate_reconstruction_attention(total, layer.queries, layer.keys, start, end,
                                            protected_prefix_len=protected_prefix_len, scaling=layer.scaling, plus=plus)


@register_policy("kvzip")
class KVzipPolicy(KVPolicy):
    needs = frozenset({"reconstruction"})
    second_pass = KVzipReconstruction()
    allocation = "global"
    # KVzip+'s score (``kvzip_plus``) instead of KVzip's raw attention weights.
    plus: ClassVar[bool] = False
    # Under --tp-size > 1 every rank queues the same reconstruction passes at the same point (the ranks
    # release the same parent in lockstep), so their schedulers stay identical (with allocation 'flat').

    def __init__(self, *, n_sink: int = 4, model_path: str | Path | None = None) -> None:
        if n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {n_sink}")
        self.n_sink = n_sink
        if self.plus and model_path:  # the served instance: its passes read the checkpoint's o_proj
            self.second_pass = KVzipReconstruction(plus=OutputProjections(model_path))

    @classmethod
    def from_config(cls, config) -> "KVzipPolicy":
        return cls(model_path=getattr(config, "model_path", None) or None)

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        scores = layer_signal(signals, "reconstruction_attention", layer, self.name).float().clone()
        scores[:, : self.n_sink] = float("inf")  # kvpress's sinks: always kept
        return scores


@register_policy("kvzip_plus")
class KVzipPlusPolicy(KVzipPolicy):
    """KVzip with KVzip+'s normalisation (module docstring): same passes, sinks and global threshold."""

    plus = True
    second_pass = KVzipReconstruction(plus=True)  # the served instance's reads the checkpoint (__init__)
    # Under --tp-size > 1 a rank's passes weight its own query heads by their slices of o_proj (PassLayer.kv_heads).
