"""``h2o`` at decode time: online heavy hitters plus recent tokens, a fixed budget per head.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (NeurIPS 2023, arXiv:2306.14048), Sec. 3-4: per layer and head the cache holds ``budget``
entries, half the most recent, half the "heavy hitters" -- the entries with the most attention
accumulated so far. After the prefill each head keeps its recent half and its heaviest older
entries; every decode step adds its query's weights to the scores and writes its entry; a head over
budget then evicts its lightest entry outside the recent half. The learned-gate paper (Li, arXiv
2608.23296, Sec. 2.5) runs it on each cell's dense backbone as the post-hoc baseline, as here:
the same rule as its oracle ``reference/gated.py: h2o_rule``.

Eviction is per head, so an entry leaves attention at once but its pool slot (which holds every
head's key) stays until the request ends: a quality baseline, not a memory saver here.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sglang_kvx.decode.base import DecodeStep, register_decode_step
from sglang_kvx.decode.head_keep import HeadRow


@register_decode_step("h2o")
class H2ODecode(DecodeStep):
    options = ("budget",)
    needs: ClassVar[frozenset[str]] = frozenset({"decode_attention_weights"})
    model_hint = "a dense cell of the learned-gate family: weights/gated/*-none"
    row_state = HeadRow
    totals = staticmethod(HeadRow.totals)
    reads_attention = True

    def __init__(self, *, budget: int = 256) -> None:
        if budget < 2:
            raise ValueError(f"budget must be >= 2 (a recent half and a heavy half), got {budget}")
        self.budget = budget
        self.recent = budget // 2

    def first_keep(self, keys: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        heads, length = attention.shape
        keep = torch.zeros((heads, length), dtype=torch.bool, device=attention.device)
        if self.budget >= length:
            return keep.fill_(True)
        keep[:, length - self.recent :] = True
        heavy = attention[:, : length - self.recent].topk(self.budget - self.recent, dim=-1).indices
        return keep.scatter_(1, heavy, True)

    def victim(self, keys: torch.Tensor, keep: torch.Tensor, attention: torch.Tensor | None,
               position: int) -> torch.Tensor:
        older = keep.clone()
        older[:, max(position + 1 - self.recent, 0) : position + 1] = False  # the recent half stays
        return attention.masked_fill(~older, float("inf")).argmin(dim=-1)
