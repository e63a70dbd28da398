"""A decode step with a mechanism of its own, in one file outside the package (issue #40's proof):
per-head eviction of the kept key most like the newest one (cosine similarity to the key just
written; KeyDiff compares with the mean key instead), a rule the project does not ship, with its own
counters in ``meta_info`` and ``/kvx/stats``.

Loaded into a server with ``--kvx-policy-modules throwaway_decode`` (tests/ on PYTHONPATH); served
on the dense cells of the learned-gate family, whose backend applies per-head keep masks.
``tests/test_head_eviction_e2e.py`` checks it against the HF oracle applying the same rule.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from sglang_kvx.decode import DecodeStep, register_decode_step
from sglang_kvx.decode.head_keep import HeadRow


class NoveltyRow(HeadRow):
    """The per-head keep masks (``HeadRow``), plus this step's own figures."""

    report = "_throwaway_novelty_requests"

    def summary(self, row: int) -> dict:
        return {**super().summary(row), "most_similar_evicted": round(self.step.most_similar, 6)}

    def release(self, row: int) -> None:
        super().release(row)
        self.facts.totals["_throwaway_novelty_finished"] += 1
        self.facts.totals["_throwaway_novelty_evicted"] += sum(self.heads.evicted)


@register_decode_step("_throwaway_novelty")
class NoveltyEviction(DecodeStep):
    options = ("budget",)
    needs: ClassVar[frozenset[str]] = frozenset({"decode_attention_weights"})
    row_state = NoveltyRow

    @classmethod
    def totals(cls, num_layers: int) -> dict:
        return {**NoveltyRow.totals(num_layers), "_throwaway_novelty_finished": 0, "_throwaway_novelty_evicted": 0}

    def __init__(self, *, budget: int = 64) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.budget = budget
        self.most_similar = -1.0

    def first_keep(self, keys: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        """The ``budget`` prefill keys least like the last one (the last one kept)."""
        heads, length, _ = keys.shape
        keep = torch.zeros((heads, length), dtype=torch.bool, device=keys.device)
        if self.budget >= length:
            return keep.fill_(True)
        similarity = F.cosine_similarity(keys, keys[:, -1:], dim=-1)
        similarity[:, -1] = float("-inf")
        return keep.scatter_(1, similarity.topk(self.budget, dim=-1, largest=False).indices, True)

    def victim(self, keys: torch.Tensor, keep: torch.Tensor, attention: torch.Tensor | None,
               position: int) -> torch.Tensor:
        """The kept key most like the one just written (never that one)."""
        similarity = F.cosine_similarity(keys, keys[:, position : position + 1], dim=-1)
        candidates = keep.clone()
        candidates[:, position] = False
        best = similarity.masked_fill(~candidates, float("-inf")).max(dim=-1)
        self.most_similar = max(self.most_similar, float(best.values.max()))
        return best.indices
