"""``keydiff`` at decode time: online KeyDiff, a fixed budget of the most distinctive keys per head.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364): per layer and head the cache holds
``budget`` entries; the anchor is the mean cached key, and a head over budget evicts the key most
cosine-similar to it -- the least distinctive. Needs no attention weights. After the prefill each
head keeps the ``budget`` prefill keys least similar to the prefill's mean key. The learned-gate
paper (Li, arXiv 2608.23296, Sec. 2.5) runs it on each cell's dense backbone as the post-hoc
baseline, as here: the same rule as its oracle ``reference/gated.py: keydiff_rule`` (the anchor is
the mean of the raw cached keys, as there).

Eviction is per head, so an entry leaves attention at once but its pool slot (which holds every
head's key) stays until the request ends: a quality baseline, not a memory saver here.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from sglang_kvx.decode.base import DecodeStep, register_decode_step
from sglang_kvx.decode.head_keep import HeadRow


@register_decode_step("keydiff")
class KeyDiffDecode(DecodeStep):
    options = ("budget",)
    needs: ClassVar[frozenset[str]] = frozenset({"decode_attention_weights"})
    model_hint = "a dense cell of the learned-gate family: weights/gated/*-none"
    row_state = HeadRow
    totals = staticmethod(HeadRow.totals)

    def __init__(self, *, budget: int = 256) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.budget = budget

    def first_keep(self, keys: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        heads, length, _ = keys.shape
        keep = torch.zeros((heads, length), dtype=torch.bool, device=keys.device)
        if self.budget >= length:
            return keep.fill_(True)
        similarity = F.cosine_similarity(keys, keys.mean(1, keepdim=True), dim=-1)
        return keep.scatter_(1, similarity.topk(self.budget, dim=-1, largest=False).indices, True)

    def victim(self, keys: torch.Tensor, keep: torch.Tensor, attention: torch.Tensor | None,
               position: int) -> torch.Tensor:
        anchor = (keys * keep[..., None]).sum(1, keepdim=True) / keep.sum(1)[:, None, None]
        similarity = F.cosine_similarity(keys, anchor, dim=-1).masked_fill(~keep, float("-inf"))
        return similarity.argmax(dim=-1)
