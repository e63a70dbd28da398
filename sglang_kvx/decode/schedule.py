"""``span_schedule``: local-first decoding with a fixed rule for when a step needs full attention.

Every step first runs with sinks + a recent window; every ``full_every``-th step is then re-run
with full attention from the same pre-step state (the row's GDN / conv state restored), and only
the full run's result is kept. It exercises the re-run path On-Demand Attention needs (there a
learned recall head, not a schedule, decides), with a rule an oracle can apply exactly. Nothing is
dropped: the full history stays, so a full step still sees everything.
"""

from __future__ import annotations

from sglang_kvx.decode.base import FULL, DecodeStep, Span, register_decode_step


@register_decode_step("span_schedule")
class SpanSchedule(DecodeStep):
    options = ("sinks", "window", "full_every")

    def __init__(self, *, sinks: int = 4, window: int = 64, full_every: int = 4) -> None:
        if window < 1 or full_every < 1:
            raise ValueError(f"window and full_every must be >= 1, got {window} and {full_every}")
        self.full_every = full_every
        self._local = Span(sinks=sinks, window=window)

    def span(self, step: int) -> Span:
        return self._local

    def may_rerun(self, step: int) -> bool:
        return step % self.full_every == 0

    def rerun_span(self, step: int, first: Span, score: float | None = None) -> Span | None:
        return FULL if self.may_rerun(step) else None
