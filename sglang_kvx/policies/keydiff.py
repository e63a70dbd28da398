"""``keydiff``: keep the keys most DIFFERENT from the layer's average key direction.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference
in Resource-Constrained Environments" (arXiv:2504.15364): per KV head, the anchor is the mean
of the L2-normalised keys; an entry's score is -cos(k_i, anchor), so the most distinctive keys
stay. Needs no attention weights. (The paper streams blocks and re-scores each block against
the running cache; a prefilled context is one block here, so the anchor covers all n keys.)

Against kvpress's KeyDiffPress (same anchor and score; it too scores the whole prefill as one
block): computed in float32 where kvpress stays in the model's dtype, and the count kept is
round(p * m) beyond the protected prefix, where kvpress keeps int(p * n) of the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy
from sglang_kvx.signals import ContextSignals


@register_policy("keydiff")
class KeyDiffPolicy(KVPolicy):
    needs = frozenset({"keys"})

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        keys = layer_signal(signals, "keys", layer, self.name).float()  # [kv_heads, n, head_dim]
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # [kv_heads, 1, head_dim]
        return -F.cosine_similarity(keys, anchor, dim=-1)
