"""The correctness oracle: the same weights run in HF transformers, independent of SGLang.

Greedy tokens and per-token log-probabilities from here are what the SGLang
server's answers are checked against. Compaction issues extend this with a
keep-set applied by slicing the cache; the uncompacted path is the base case.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch

# transformers routes Qwen3.5 GDN layers to flash-linear-attention when it is
# importable; the pure-torch path is the one that runs on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


ORACLE_ATTENTION = "kvx_compacted_oracle"


def _compacted_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention over [compacted prefix ; new tokens], ignoring the model's own mask.

    After compaction the cache holds K_l prefix entries per layer while positions
    continue from the true context length, so the usual mask (built from
    positions) does not fit. Query i of q new tokens sees every prefix entry and
    the new tokens up to itself: key j is visible iff j < Lk - q + i + 1.
    """
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    q_len, k_len = query.shape[2], key.shape[2]
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    keys, current = torch.arange(k_len)[None, :], (k_len - q_len + torch.arange(q_len))[:, None]
    visible = keys <= current
    span = kwargs.get("kvx_local_span")
    if span is not None:
        sinks, window = span
        visible &= (keys < sinks) | (keys > current - window)
    valid = (kwargs.get("kvx_prefix_valid") or {}).get(module.layer_idx)
    if valid is not None:  # per-head budgets: a head's padded prefix entries are not there
        prefix = torch.ones(valid.shape[0], k_len, dtype=torch.bool)
        prefix[:, : valid.shape[1]] = valid
        visible = visible[None, None] & prefix.repeat_interleave(group, 0)[None, :, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _register_oracle_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ORACLE_ATTENTION, _compacted_attention)


class HFReference:
    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        self.model_path = str(model_path)
        self.dtype = dtype

    @cached_property
    def model(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        return model.eval()

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def stop_ids(self) -> set[int]:
        """The token ids the SGLang server ends a request on (``Req._check_token_based_finish``): the
        config's and generation_config's ``eos_token_id`` and the tokenizer's EOS."""
        ids: set[int] = set()
        for source in (self.model.config, getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids exactly as SGLang's /generate builds them for a text prompt."""
        return self.tokenizer(text).input_ids

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt, as /v1/chat/completions renders it."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    @torch.no_grad()
    def logits(self, input_ids: list[int]) -> torch.Tensor:
        """[T, vocab] float32 logits for every prompt position."""
        ids = torch.tensor([input_ids])
        return self.model(ids).logits[0].float()

    @torch.no_grad()
    def greedy(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation (no EOS stop: compare the full requested length)."""
        ids = torch.tensor([input_ids])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return out[0, len(input_ids):].tolist()

    @torch.no_grad()
    def prompt_logprobs(self, input_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1, as SGLang's input_token_logprobs reports them."""
        logp = torch.log_softmax(self.logits(input_ids), dim=-1)
        return [float(logp[t - 1, input_ids[t]]) for t in range(1, len(input_ids))]

    # --- compaction oracle -------------------------------------------------------

    @cached_property
    def attention_layer_ids(self) -> list[int]:
        """Model layer index of each full-attention layer, in order."""
        types = getattr(self.model.config, "layer_types", None)
        if types:
            return [i for i, t in enumerate(types) if t == "full_attention"]
        return list(range(self.model.config.num_hidden_layers))

    def compacted_greedy(
        self, context_ids: list[int], keep: list[torch.Tensor], question_ids: list[int], max_new_tokens: int
    ) -> list[int]:
        return self.compacted_generate(context_ids, keep, question_ids, max_new_tokens)[0]

    @torch.no_grad()
    def compacted_generate(
        self, context_ids: list[int], keep: list[torch.Tensor], question_ids: list[int], max_new_tokens: int,
        attention: str = ORACLE_ATTENTION,
    ) -> tuple[list[int], list[float]]:
        """Prefill the context, keep per attention layer and KV head only the positions in ``keep``
        (keep[l]: LongTensor [kv_heads, K_l]), then answer the question greedily from that cache.
        Returns the tokens and the log-probability of each. With per-head budgets keep[l] is a list of
        one LongTensor [K_lh] per KV head: the heads' caches are padded to the longest and the padding
        hidden.

        GDN states are left as the full prefill produced them; later tokens keep their true positions.
        ``attention``: the registered attention the question's tokens run with (the prefill runs with
        the model's current one).
        """
        model = self.model
        cache, valid = self.compacted_cache(context_ids, keep)
        with self.oracle_attention(attention):
            n = len(context_ids)
            generated: list[int] = []
            logprobs: list[float] = []
            step_ids = list(question_ids)
            position = n
            for _ in range(max_new_tokens):
                ids = torch.tensor([step_ids])
                positions = torch.arange(position, position + len(step_ids))[None]
                logits = model(ids, position_ids=positions, cache_position=positions[0], past_key_values=cache,
                               use_cache=True, **valid).logits
                token = int(logits[0, -1].argmax())
                generated.append(token)
                logprobs.append(float(torch.log_softmax(logits[0, -1].float(), dim=-1)[token]))
                position += len(step_ids)
                step_ids = [token]
            return generated, logprobs

    @torch.no_grad()
    def compacted_prompt_logprobs(
        self, context_ids: list[int], keep: list[torch.Tensor], question_ids: list[int], attention: str = ORACLE_ATTENTION,
    ) -> list[float]:
        """log p(question_t | compacted context, question_<t) for t >= 1: a child's input_token_logprobs
        past its first question token, teacher-forced over the cache ``compacted_generate`` reads."""
        cache, valid = self.compacted_cache(context_ids, keep)
        with self.oracle_attention(attention):
            positions = torch.arange(len(context_ids), len(context_ids) + len(question_ids))[None]
            logits = self.model(torch.tensor([question_ids]), position_ids=positions, cache_position=positions[0],
                                past_key_values=cache, use_cache=True, **valid).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [float(logp[t - 1, question_ids[t]]) for t in range(1, len(question_ids))]

    @contextmanager
    def oracle_attention(self, attention: str = ORACLE_ATTENTION):
        """The model runs with the registered ``attention`` inside (the compacted cache's oracle)."""
        _register_oracle_attention()
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(attention)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    def compacted_cache(self, context_ids: list[int], keep: list[torch.Tensor | list[torch.Tensor]]):
        """The context's prefill cache with each attention layer cut to its kept positions per KV head,
        and the forward kwargs hiding per-head padding ({} when every head of a layer keeps as many)."""
        if len(keep) != len(self.attention_layer_ids):
            raise ValueError(f"keep has {len(keep)} layers, the model has {len(self.attention_layer_ids)} attention layers")
        cache = self.model(torch.tensor([context_ids]), use_cache=True).past_key_values
        valid: dict[int, torch.Tensor] = {}
        for positions, layer_id in zip(keep, self.attention_layer_ids):
            if isinstance(positions, list):  # per-head counts: pad with position 0, hidden by the mask
                width = max(int(h.numel()) for h in positions)
                valid[layer_id] = torch.stack([torch.arange(width) < h.numel() for h in positions])
                positions = torch.stack([torch.cat([h.long(), h.new_zeros(width - h.numel()).long()]) for h in positions])
            layer = cache.layers[layer_id]
            index = positions.to(torch.long)[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        return cache, ({"kvx_prefix_valid": valid} if valid else {})

    @torch.no_grad()
    def span_generate(
        self, input_ids: list[int], max_new_tokens: int, span_of_step: Callable[[int], tuple[int, int | None]],
        progress: bool = False,
    ) -> tuple[list[int], list[float]]:
        """Greedy generation where decode step t (feeding output token t; the prompt's prefill has full
        attention) attends only to its span: span_of_step(t) = (sinks, window) reads the first ``sinks``
        keys and the ``window`` most recent (the current one included), (0, None) reads all. Nothing is
        evicted: the rest of the cache is masked out with HF's own attention mask. Returns the tokens
        and the log-probability of each."""
        model = self.model
        out = model(torch.tensor([input_ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in greedy_steps(max_new_tokens, progress, "HF span oracle"):
            if take_greedy(logits, tokens, logprobs) == max_new_tokens:
                break
            seq_len = len(input_ids) + len(tokens)  # keys this step reads, its own included
            sinks, window = span_of_step(len(tokens))
            mask = torch.ones(1, seq_len, dtype=torch.long)
            if window is not None:
                mask[0, min(sinks, seq_len) : max(sinks, seq_len - window)] = 0
            position = torch.tensor([[seq_len - 1]])
            logits = model(torch.tensor([tokens[-1:]]), attention_mask=mask, position_ids=position,
                           cache_position=position[0], past_key_values=cache, use_cache=True).logits[0, -1]
        return tokens, logprobs

    @torch.no_grad()
    def streaming_generate(
        self, input_ids: list[int], max_new_tokens: int, sinks: int, window: int, progress: bool = False
    ) -> tuple[list[int], list[float]]:
        """Greedy generation under StreamingLLM decoding: the prompt is prefilled with full attention;
        decode step t reads only the first ``sinks`` keys and the ``window`` most recent (its own
        included), and whatever leaves that span is cut out of HF's cache for good, so each step
        costs O(sinks + window). Later tokens keep their true positions. Returns tokens and log-probs."""
        model = self.model
        out = model(torch.tensor([input_ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        cached = torch.arange(len(input_ids))  # the position each cache entry holds
        tokens: list[int] = []
        logprobs: list[float] = []
        with self.oracle_attention():
            for _ in greedy_steps(max_new_tokens, progress, "HF streaming oracle"):
                if take_greedy(logits, tokens, logprobs) == max_new_tokens:
                    break
                seq_len = len(input_ids) + len(tokens)  # keys this step reads, its own included
                keep = (cached < sinks) | (cached >= seq_len - window)
                if not bool(keep.all()):
                    index = keep.nonzero(as_tuple=True)[0]
                    for layer_id in self.attention_layer_ids:
                        layer = cache.layers[layer_id]
                        layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
                    cached = cached[index]
                cached = torch.cat([cached, torch.tensor([seq_len - 1])])
                position = torch.tensor([[seq_len - 1]])
                logits = model(torch.tensor([tokens[-1:]]), position_ids=position, cache_position=position[0],
                               past_key_values=cache, use_cache=True).logits[0, -1]
            return tokens, logprobs


def greedy_steps(count: int, progress: bool, description: str):
    if not progress:
        return range(count)
    from tqdm import tqdm

    return tqdm(range(count), desc=description, unit="tok", mininterval=5)


def take_greedy(logits: torch.Tensor, tokens: list[int], logprobs: list[float]) -> int:
    """Append the greedy token of ``logits`` and its log-probability; returns how many tokens there are."""
    token = int(logits.argmax())
    tokens.append(token)
    logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
    return len(tokens)
