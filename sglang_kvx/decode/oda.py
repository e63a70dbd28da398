"""``oda``: On-Demand Attention (seed 003, section 2) — local-first decoding; a learned recall head
decides when a step needs Full attention.

Every decode step first runs Local attention (the first ``sinks`` keys plus the ``window`` most
recent, the current one included). The server's recall head (``recall_head.py``) scores the step
from the previous committed final hidden state, the current token's embedding and the Local final
hidden state; a score above ``theta`` (0 by default; a score that is not finite counts as above)
re-runs the step with Full attention from the same pre-step state, and only that run is kept
(Eq. 4: r_t = 1[s_t > theta]). Nothing is dropped: what Local skipped stays for later Full steps.
The prefill runs Full; the first routed step consumes the token it produced (the handoff of 2.1).
"""

from __future__ import annotations

import math

from sglang_kvx.decode.base import FULL, DecodeStep, Span, register_decode_step
from sglang_kvx.decode.row_state import RowState


class RoutedRow(RowState):
    """A request under On-Demand Attention: its last committed final hidden state (the recall head's
    ``prev_h``, seeded by the prefill) and how many of its steps were re-run with Full attention."""

    report = "oda_requests"

    def __init__(self, step, request, facts) -> None:
        super().__init__(step, request, facts)
        self.prev_hidden = None  # torch.Tensor [hidden]
        self.routed = 0
        self.full_steps = 0

    def chose(self, span: Span | None) -> None:
        full = span is not None and span.full
        self.routed += 1
        self.full_steps += full
        totals = self.facts.totals
        totals["oda_routed_steps"] += 1
        totals["oda_full_steps"] += full
        totals["oda_full_rate"] = round(totals["oda_full_steps"] / totals["oda_routed_steps"], 6)

    def summary(self, row: int) -> dict:
        return {"decode": self.step.name, "routed_steps": self.routed, "full_steps": self.full_steps,
                "full_rate": round(self.full_steps / self.routed, 6) if self.routed else 0.0}

    def outcome(self, row: int) -> dict:
        """The summary and the FLOPs ledger of the schedule it ran (seed 003, Eqs. 24-25)."""
        from sglang_kvx.decode.flops import oda_flops

        head = self.facts.recall_head
        ledger = oda_flops(self.facts.model_path, len(self.request.input_ids), self.step.schedule,
                           sinks=self.step.sinks, window=self.step.window, head_flops=head.flops() if head else 0)
        return {**self.summary(row), "flops": {key: ledger[key] for key in ("full_flops", "oda_flops", "saved_fraction")}}


@register_decode_step("oda")
class OnDemandAttention(DecodeStep):
    options = ("sinks", "window")
    real_options = ("theta",)
    reads_hidden = True
    row_state = RoutedRow

    @classmethod
    def totals(cls, num_layers: int) -> dict:
        return {"oda_routed_steps": 0, "oda_full_steps": 0, "oda_full_rate": 0.0}

    def __init__(self, *, sinks: int = 4, window: int = 128, theta: float = 0.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.sinks, self.window, self.theta = sinks, window, theta
        self._local = Span(sinks=sinks, window=window)
        self.schedule: list[bool] = []  # per routed step: whether it ran Full (the FLOPs ledger's input)

    def span(self, step: int) -> Span:
        return self._local

    def may_rerun(self, step: int) -> bool:
        return True

    def rerun_span(self, step: int, first: Span, score: float | None = None) -> Span | None:
        full = score is None or not math.isfinite(score) or score > self.theta
        self.schedule.append(full)
        return FULL if full else None
