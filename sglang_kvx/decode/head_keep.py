"""Per-head eviction during decode: the per-row state of the ``h2o`` and ``keydiff`` decode steps.

A row whose step keeps per-head budgets (its row state is ``HeadRow``) holds, per attention layer,
which entries each KV head keeps and (steps that ``reads_attention``) the attention each entry was
paid so far. The attention backend asks every row for its ``visibility`` one layer at a time and
hands back what ran (``after_attention``): in a prefill, the weights its queries paid; in a decode
step, the row reads its keep mask (the kept entries plus the step's own), then the step's entry
joins and a head over its budget evicts the entry the step names. Evicted entries leave attention
at once; their slots stay (every head's key shares one slot) until the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvx.decode.base import DecodeStep
from sglang_kvx.decode.row_state import KeysOf, RowState, Visibility


def _grown(t: torch.Tensor | None, heads: int, length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``t`` with room for ``length`` positions (doubling), zero-filled past what it held."""
    if t is not None and t.shape[1] >= length:
        return t
    out = torch.zeros((heads, max(length, 2 * (t.shape[1] if t is not None else 0), 64)), dtype=dtype, device=device)
    if t is not None:
        out[:, : t.shape[1]] = t
    return out


@dataclass
class HeadKeep:
    """One row's per-head state, per attention layer (None until the layer needs it)."""

    step: DecodeStep
    num_layers: int
    keep: list[torch.Tensor | None] = field(default_factory=list)  # [H, capacity] bool, from the first decode step
    attention: list[torch.Tensor | None] = field(default_factory=list)  # [H, capacity] float32 (reads_attention)
    evicted: list[int] = field(default_factory=list)  # entries evicted per layer, over its heads

    def __post_init__(self) -> None:
        self.keep = [None] * self.num_layers
        self.attention = [None] * self.num_layers
        self.evicted = [0] * self.num_layers

    def add_attention(self, layer: int, weights: torch.Tensor) -> None:
        heads, length = weights.shape
        self.attention[layer] = _grown(self.attention[layer], heads, length, torch.float32, weights.device)
        self.attention[layer][:, :length] += weights.float()

    def mask(self, layer: int, seq_len: int, keys_of: KeysOf) -> torch.Tensor:
        """What each head reads at a decode step with ``seq_len`` keys: its kept entries and the step's own."""
        if self.keep[layer] is None:  # the first decode step: the prefill's entries are cut to the budget
            keys = keys_of(seq_len - 1)
            attention = self.attention[layer][:, : seq_len - 1] if self.step.reads_attention else None
            if self.step.reads_attention and (attention is None or attention.shape[1] < seq_len - 1):
                raise RuntimeError(f"decode step {self.step.name!r}: no prefill attention for layer {layer}")
            first = self.step.first_keep(keys.float(), attention)
            self.keep[layer] = _grown(first, first.shape[0], seq_len, torch.bool, first.device)
            self.evicted[layer] += int((~first).sum())
        keep = self.keep[layer] = _grown(self.keep[layer], self.keep[layer].shape[0], seq_len, torch.bool,
                                         self.keep[layer].device)
        mask = keep[:, :seq_len].clone()
        mask[:, seq_len - 1] = True
        return mask

    def after_step(self, layer: int, seq_len: int, weights: torch.Tensor | None,
                   keys_of: KeysOf) -> None:
        """The step at position ``seq_len - 1`` ran: its weights count, its entry joins, a head over budget evicts."""
        if self.step.reads_attention:
            self.add_attention(layer, weights)
        keep = self.keep[layer]
        keep[:, seq_len - 1] = True
        if int(keep[0, :seq_len].sum()) > self.step.budget:  # every head holds the same count
            attention = self.attention[layer][:, :seq_len] if self.step.reads_attention else None
            victim = self.step.victim(keys_of(seq_len).float(), keep[:, :seq_len], attention, seq_len - 1)
            keep[torch.arange(keep.shape[0], device=keep.device), victim.to(keep.device)] = False
            self.evicted[layer] += keep.shape[0]

    def live_per_layer(self, seq_len: int) -> list[float]:
        """Entries each layer's heads hold on average (all of them where no decode step ran yet)."""
        return [float(k[:, :seq_len].sum(1).float().mean()) if k is not None else float(seq_len) for k in self.keep]


class HeadRow(RowState):
    """A request under per-head eviction: its ``HeadKeep``; its report, the mean live entries per
    layer's heads and what they evicted."""

    report = "head_eviction_requests"

    def __init__(self, step, request, facts) -> None:
        super().__init__(step, request, facts)
        self.heads = HeadKeep(step, facts.pool.num_layers)
        self.kv_len = 0

    @staticmethod
    def totals(num_layers: int) -> dict:
        return {"head_eviction_finished": 0,  # finished requests under online H2O / KeyDiff
                "head_evicted_entries": 0}  # ... entries they evicted, over layers and heads

    def after_step(self, row: int, seq_len: int) -> None:
        self.kv_len = seq_len

    def visibility(self, layer: int, seq_len: int, keys_of: KeysOf, decode: bool) -> Visibility:
        """Decode: each head reads its kept entries and the step's own; a prefill reads all (and
        pays attention the step may count)."""
        return Visibility(head_mask=self.heads.mask(layer, seq_len, keys_of) if decode else None,
                          wants_attention=self.step.reads_attention)

    def after_attention(self, layer: int, seq_len: int, weights, keys_of: KeysOf, decode: bool) -> None:
        if decode:
            self.heads.after_step(layer, seq_len, weights, keys_of)
        elif weights is not None:
            self.heads.add_attention(layer, weights)

    def summary(self, row: int) -> dict:
        live = self.heads.live_per_layer(self.kv_len or len(self.request.input_ids))
        return {"decode": self.step.name, "budget": self.step.budget,
                "live_entries_per_layer": {str(layer): round(n, 3) for layer, n in enumerate(live)},
                "evicted_entries": sum(self.heads.evicted)}

    def release(self, row: int) -> None:
        self.facts.totals["head_eviction_finished"] += 1
        self.facts.totals["head_evicted_entries"] += sum(self.heads.evicted)
