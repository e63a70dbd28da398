"""Selection: per layer and KV head, the protected prefix plus the top-scoring entries under the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvx.allocate import allocation_reads_scores, fill_pages, flat_budget, head_budgets, layer_budgets
from sglang_kvx.ops.compaction import topk_per_head
from sglang_kvx.policies.base import KVPolicy
from sglang_kvx.signals import ContextSignals


@dataclass
class KeepSet:
    """What a compacted context keeps.

    positions[l]: LongTensor [kv_heads, K_l] of kept positions in attention layer l, ascending per
    head; K_l = protected_prefix_len + budget_l, and every head keeps positions [0, protected_prefix_len).
    With per-head budgets (an allocation that reads scores, ``allocate.head_budgets``) the heads of a
    layer may keep different counts: positions[l] is then a list of one LongTensor [K_lh] per head.
    """

    positions: list[torch.Tensor | list[torch.Tensor]]
    n: int
    protected_prefix_len: int

    @property
    def num_layers(self) -> int:
        return len(self.positions)

    @property
    def per_head(self) -> bool:
        """Whether some layer's KV heads keep different counts."""
        return any(isinstance(p, list) for p in self.positions)

    @property
    def kept_per_head(self) -> list[list[int]]:
        return [[int(h.numel()) for h in p] if isinstance(p, list) else [p.shape[1]] * p.shape[0] for p in self.positions]

    @property
    def kept_per_layer(self) -> list[int]:
        """Entries each KV head of a layer keeps; with per-head budgets their mean, rounded up."""
        return [-(-sum(heads) // len(heads)) for heads in self.kept_per_head]

    def head_positions(self, layer: int) -> list[torch.Tensor]:
        """Layer ``layer``'s kept positions, one LongTensor per KV head."""
        p = self.positions[layer]
        return list(p) if isinstance(p, list) else list(p.unbind(0))

    def mask(self, layer: int) -> torch.Tensor:
        """BoolTensor [kv_heads, n]: True where layer ``layer`` keeps the entry."""
        heads = self.head_positions(layer)
        mask = torch.zeros(len(heads), self.n, dtype=torch.bool, device=heads[0].device)
        for head, keep in enumerate(heads):
            mask[head, keep] = True
        return mask


def select_keep_set(scores: list[torch.Tensor], budgets: list[int] | list[list[int]], protected_prefix_len: int) -> KeepSet:
    """Per layer l: each KV head keeps [0, protected_prefix_len) plus its budgets[l] best-scoring other
    entries (budgets[l][h] for head h, when budgets are per head).

    scores[l]: float [kv_heads, n]. A budget above the n - protected_prefix_len entries left is
    clamped (everything is kept).
    """
    if len(scores) != len(budgets):
        raise ValueError(f"{len(scores)} layers of scores but {len(budgets)} budgets")
    if not scores:
        raise ValueError("no attention layers to select from")
    n = scores[0].shape[-1]
    if protected_prefix_len < 0:
        raise ValueError(f"protected_prefix_len must be >= 0, got {protected_prefix_len}")
    if protected_prefix_len > n:
        raise ValueError(f"protected prefix of {protected_prefix_len} tokens is longer than the context ({n} tokens)")
    positions = []
    for layer, (layer_scores, budget) in enumerate(zip(scores, budgets)):
        if layer_scores.dim() != 2 or layer_scores.shape[1] != n:
            raise ValueError(f"layer {layer}: scores must be [kv_heads, {n}], got {tuple(layer_scores.shape)}")
        per_head = budget if isinstance(budget, (list, tuple)) else [budget] * layer_scores.shape[0]
        if len(per_head) != layer_scores.shape[0] or min(per_head) < 0:
            raise ValueError(f"layer {layer}: budgets must be >= 0, one per KV head; got {budget}")
        if len(set(per_head)) == 1:
            positions.append(topk_per_head(layer_scores, per_head[0], protected_prefix_len))
        else:
            positions.append([topk_per_head(layer_scores[h : h + 1], b, protected_prefix_len)[0]
                              for h, b in enumerate(per_head)])
    return KeepSet(positions=positions, n=n, protected_prefix_len=protected_prefix_len)


def choose_keep_set(
    policy: KVPolicy, signals: ContextSignals, keep_fraction: float, allocation: str | None = None,
    *, page_size: int = 1, fold: bool = True,
) -> KeepSet:
    """The whole score -> allocate -> select step for one prefilled context.

    ``allocation`` overrides the policy's own (e.g. "gate" under SnapKV scores); the policy's
    allocation options (PyramidKV's beta) go only to its own allocation. With ``page_size`` > 1
    the budgets are raised to fill the context's last page (``allocate.fill_pages``; ``fold`` says
    how the context's slots are counted).
    """
    protected = signals.protected_prefix_len
    if not 0 <= protected <= signals.n:
        raise ValueError(f"protected prefix of {protected} tokens does not fit the context ({signals.n} tokens)")
    name = allocation or policy.allocation
    options = policy.allocation_options if name == policy.allocation else {}
    policy = policy.under(name)
    if allocation_reads_scores(name):  # scored first (with flat budgets as the layers' hint), then budgeted per head
        if page_size > 1:
            raise ValueError(f"allocation {name!r} budgets each KV head, which whole pages cannot hold yet")
        if not fold:
            raise ValueError(f"allocation {name!r} needs every attention layer's entries in one shape (folded layout)")
        scores = _checked(policy, signals, policy.score_layers(signals, [flat_budget(keep_fraction, signals.n - protected)] * signals.num_layers))
        budgets = head_budgets(name, keep_fraction, [s[:, protected:] for s in scores], signals, **options)
        return select_keep_set(scores, budgets, protected)
    budgets = layer_budgets(name, keep_fraction, signals.n - protected, signals.num_layers, signals, **options)
    budgets = fill_pages(budgets, signals.n - protected, protected, page_size, fold)
    return select_keep_set(_checked(policy, signals, policy.score_layers(signals, budgets)), budgets, protected)


def _checked(policy: KVPolicy, signals: ContextSignals, scores: list[torch.Tensor]) -> list[torch.Tensor]:
    for layer, layer_scores in enumerate(scores):
        expected = (signals.num_kv_heads, signals.n)
        if tuple(layer_scores.shape) != expected:
            raise ValueError(f"policy {policy.name!r} scored layer {layer} as {tuple(layer_scores.shape)}, expected {expected}")
    return scores
