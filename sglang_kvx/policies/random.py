"""``random``: keep a uniformly random subset of entries (the floor every policy must beat).

As kvpress's RandomPress: every (layer, KV head, entry) draws an independent uniform score. The
draw is seeded per (seed, layer), so a context compacts the same way on every run and every rank.

Against kvpress's RandomPress: the same distribution, not the same numbers. kvpress draws from
torch's global generator (reseeded with the same seed at every layer when a seed is given, so every
layer draws alike); here each layer has its own CPU generator, so layers differ but runs and tensor
parallel ranks agree. The count kept is round(p * m), kvpress's int(p * n).
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.base import KVPolicy, check_layer, register_policy
from sglang_kvx.signals import ContextSignals


@register_policy("random")
class RandomPolicy(KVPolicy):
    needs = frozenset()

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        check_layer(signals, layer)
        # A CPU generator: the same numbers whatever device the keys live on.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        scores = torch.rand(signals.num_kv_heads, signals.n, generator=generator)
        return scores.to(signals.score_device)
