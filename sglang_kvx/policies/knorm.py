"""``knorm``: keep the keys with the LOWEST L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(EMNLP 2024, arXiv:2406.11430): a low key norm goes with high attention, so the score is
-||k||_2, needing neither queries nor attention weights.

Against kvpress's KnormPress (same score, -keys.norm, taken in float32 by both since kvpress 0.5.5;
earlier kvpress releases took it in the model's dtype, where bf16 ties could break differently): the
count kept is round(p * m) beyond the protected prefix, where kvpress keeps int(p * n) (truncated)
of the whole context. Otherwise the keep sets are kvpress's.
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy
from sglang_kvx.signals import ContextSignals


@register_policy("knorm")
class KNormPolicy(KVPolicy):
    needs = frozenset({"keys"})

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        keys = layer_signal(signals, "keys", layer, self.name)  # [kv_heads, n, head_dim]
        return -keys.float().norm(dim=-1)
