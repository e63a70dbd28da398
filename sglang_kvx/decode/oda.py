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


@register_decode_step("oda")
class OnDemandAttention(DecodeStep):
    options = ("sinks", "window")
    real_options = ("theta",)
    reads_hidden = True

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
