"""The correctness oracle: the same weights run in HF transformers, independent of SGLang.

Greedy tokens and per-token log-probabilities from here are what the SGLang
server's answers are checked against. Compaction issues extend this with a
keep-set applied by slicing the cache; the uncompacted path is the base case.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path

import torch

# transformers routes Qwen3.5 GDN layers to flash-linear-attention when it is
# importable; the pure-torch path is the one that runs on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
