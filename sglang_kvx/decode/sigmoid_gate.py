"""``sigmoid-gate``: learned-gate eviction (Li, "Sigmoid Attention as a Better Substrate for Learned
KV Cache Eviction", arXiv 2608.23296, Sec. 2.3 and 2.5).

A gated model (``models/gated.py``) writes, with every token's KV entry in layer l + 1, the gate
g = sigmoid(w_l . x + b_l) its layer l learned. At inference every entry with g < tau is deleted:
after the prefill (the prefill itself reads every entry with its soft gate) and, during decode, each
newly written entry right after the step that wrote it. Retained entries keep their learned logit
and value scaling. Layer 0 has no gate and keeps everything; tau = 0 deletes nothing.

The deletion itself lives where the gates are, in the gated attention op
(``ops/gated_attention.py``): a decode query of a row with this step skips keys with g < tau. The
threshold comes from the checkpoint's manifest (``tau``, frozen on validation by
``perf/bench_gate_eviction.py``) unless the request or ``--kvx-decode`` names one.
"""

from __future__ import annotations

from typing import ClassVar

from sglang_kvx.compact.gate_fold import FoldedRow, fold_row
from sglang_kvx.decode.base import DecodeStep, register_decode_step
from sglang_kvx.decode.row_state import RowState, Visibility


class GateRow(RowState):
    """A request under learned-gate eviction: the stretch of its own positions re-folded so far (every
    ``facts.fold_every`` steps the cells its deleted entries held go back to the pool) and, per
    attention layer past the first, what it deleted -- counted from the gates when asked, not at
    every step."""

    report = "gate_requests"

    def __init__(self, step, request, facts) -> None:
        super().__init__(step, request, facts)
        self.fold: FoldedRow | None = None
        self.kv_len = 0  # keys its last decode step read
        self.steps = 0
        self.deleted: dict[int, tuple[int, int, int]] = {}  # layer -> (prefill, decode, live)
        self.counted_len = -1  # the kv_len those counts are for

    def after_step(self, row: int, seq_len: int) -> None:
        self.kv_len = seq_len
        self.steps += 1
        self._maybe_fold(row, seq_len)

    def visibility(self, layer: int, seq_len: int, keys_of, decode: bool) -> Visibility | None:
        """A decode query skips keys under the step's threshold and reads the fold for its stretch."""
        return Visibility(gate_threshold=self.step.gate_threshold(), fold=self.fold) if decode else None

    def _maybe_fold(self, row: int, seq_len: int) -> None:
        facts, tau = self.facts, self.step.gate_threshold()
        if facts.gates is None or tau <= 0 or self.steps % facts.fold_every:
            return
        start = self.fold.start if self.fold is not None else self.request.owned_from
        if self.fold is not None and self.request.owned_from > start:
            raise NotImplementedError("learned-gate folding: the prefix cache took positions already folded")
        if seq_len - (self.fold.end if self.fold is not None else start) <= 0:
            return
        previous = self.fold
        fold = fold_row(facts.pool, facts.gates, facts.pool.row(row, seq_len), start, seq_len,
                        len(self.request.input_ids), tau, previous)
        if fold is None:
            facts.totals["gate_folds_skipped_no_room"] += 1
            return
        released = (previous.slots.numel() if previous is not None else 0) + seq_len - (previous.end if previous else start)
        facts.totals["gate_folds"] += 1
        facts.totals["gate_freed_bytes"] += ((released - fold.slots.numel()) * facts.pool.bytes_per_entry
                                             * facts.pool.num_layers)
        self.fold = fold
        self.freed = (start, seq_len)

    def _count(self, row: int) -> None:
        """Entries under its threshold among the keys its last step read (the current one included:
        used by that step, deleted after it), per attention layer past the first (the first has no
        gate); the fold's counts for the stretch it holds."""
        pool, gates = self.facts.pool, self.facts.gates
        if gates is None or self.kv_len in (0, self.counted_len):
            return
        self.counted_len = self.kv_len
        tau, fold = self.step.gate_threshold(), self.fold
        prompt_len = len(self.request.input_ids)
        slots = pool.row(row, self.kv_len)
        for layer in range(1, pool.num_layers):
            below = (gates[pool.layer_id(layer), slots] < tau).cpu()
            if fold is not None:
                below[fold.start : fold.end] = False  # those cells are gone; the fold counts them
            prefill = int(below[:prompt_len].sum())
            decode = int(below.sum()) - prefill
            live = below.numel() - int(below.sum())
            if fold is not None:
                prefill += fold.deleted_prompt[layer]
                decode += fold.deleted_generated[layer]
                live += fold.kept(layer) - (fold.end - fold.start)
            self.deleted[layer] = (prefill, decode, live)

    def summary(self, row: int) -> dict | None:
        self._count(row)
        if not self.deleted:
            return None
        pool, fold, layers = self.facts.pool, self.fold, sorted(self.deleted)
        prefill = sum(self.deleted[layer][0] for layer in layers)
        decode = sum(self.deleted[layer][1] for layer in layers)
        return {"decode": self.step.name, "tau": self.step.gate_threshold(),
                "live_entries_per_layer": {str(layer): self.deleted[layer][2] for layer in layers},
                "deleted_at_prefill": prefill, "deleted_at_decode": decode,
                "deleted_bytes": (prefill + decode) * pool.bytes_per_entry,
                "folds": fold.folds if fold is not None else 0,
                "freed_bytes": (fold.end - fold.start - fold.slots.numel()) * pool.bytes_per_entry * pool.num_layers
                if fold is not None else 0}

    def release(self, row: int) -> None:
        self._count(row)
        if self.fold is not None:
            self.facts.pool.free(self.fold.slots)
        if not self.deleted:
            return
        totals = self.facts.totals
        totals["gate_eviction_requests"] += 1
        for layer, (prefill, decode, _live) in self.deleted.items():
            totals["gate_deleted_per_layer"][layer]["prefill"] += prefill
            totals["gate_deleted_per_layer"][layer]["decode"] += decode
            totals["gate_deleted_bytes"] += (prefill + decode) * self.facts.pool.bytes_per_entry


@register_decode_step("sigmoid-gate")
class SigmoidGateEviction(DecodeStep):
    real_options = ("tau",)
    needs: ClassVar[frozenset[str]] = frozenset({"learned_gates"})
    model_hint = "a gated checkpoint: weights/gated/*-gate"
    row_state = GateRow

    @classmethod
    def totals(cls, num_layers: int) -> dict:
        return {"gate_eviction_requests": 0,  # finished requests that ran learned-gate eviction
                "gate_deleted_bytes": 0,
                # Re-folding: pool slots returned while the requests ran (net of the folds' own slots).
                "gate_folds": 0, "gate_folds_skipped_no_room": 0, "gate_freed_bytes": 0,
                # Per attention layer: entries deleted after the prefill and during decode.
                "gate_deleted_per_layer": [{"prefill": 0, "decode": 0} for _ in range(num_layers)]}

    def __init__(self, *, tau: float = 0.0) -> None:
        if not 0.0 <= tau < 1.0:
            raise ValueError(f"tau must be in [0, 1), got {tau:g}")
        self.tau = tau

    def gate_threshold(self) -> float:
        return self.tau
