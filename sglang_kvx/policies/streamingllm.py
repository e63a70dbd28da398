"""``streamingllm``: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
arXiv:2309.17453): keep the first 4 tokens (the sinks that soak up attention mass) and a
window of the most recent ones; everything in between goes. As a score: sinks rank above
every other entry, the rest rank by position, so top-K = sinks + the K - sinks most recent.
Sinks inside the protected prefix are kept there and cost no budget.

Against kvpress's StreamingLLMPress (4 sinks too): kvpress encodes the keep set as a 0/1 score
that already depends on its compression ratio (zeros on the n_pruned entries after the sinks);
here the score is the position, so one ranking serves every budget (the per-layer allocations and
the protected prefix need that). Same keep set when the counts agree; kvpress keeps int(p * n).
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.base import KVPolicy, check_layer, register_policy
from sglang_kvx.signals import ContextSignals


@register_policy("streamingllm")
class StreamingLLMPolicy(KVPolicy):
    needs = frozenset()

    def __init__(self, *, num_sinks: int = 4) -> None:
        if num_sinks < 0:
            raise ValueError(f"num_sinks must be >= 0, got {num_sinks}")
        self.num_sinks = num_sinks

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        check_layer(signals, layer)
        n = signals.n
        device = signals.score_device
        scores = torch.arange(n, dtype=torch.float32, device=device)
        # Sinks score above every position (n and up), the first token highest: a budget
        # smaller than the sinks keeps the earliest ones, where the attention mass sits.
        num_sinks = min(self.num_sinks, n)
        scores[:num_sinks] = n + torch.arange(num_sinks, 0, -1, dtype=torch.float32, device=device)
        return scores.expand(signals.num_kv_heads, n).clone()
