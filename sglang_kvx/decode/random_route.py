"""``random_route``: local-first decoding where chance, not a head, picks the Full steps.

On-Demand Attention's baseline (seed 003, Table 1's "random routing at the same rate"): every step
runs Local first and is re-run with Full attention with probability ``rate``, drawn from a
generator seeded by ``seed`` and the step number, so a run is repeatable.
"""

from __future__ import annotations

import random

from sglang_kvx.decode.base import FULL, DecodeStep, Span, register_decode_step


@register_decode_step("random_route")
class RandomRoute(DecodeStep):
    options = ("sinks", "window", "seed")
    real_options = ("rate",)

    def __init__(self, *, sinks: int = 4, window: int = 128, rate: float = 0.5, seed: int = 0) -> None:
        if window < 1 or not 0.0 <= rate <= 1.0:
            raise ValueError(f"window must be >= 1 and rate in [0, 1], got {window} and {rate}")
        self.rate, self.seed = rate, seed
        self._local = Span(sinks=sinks, window=window)

    def span(self, step: int) -> Span:
        return self._local

    def may_rerun(self, step: int) -> bool:
        return True

    def rerun_span(self, step: int, first: Span, score: float | None = None) -> Span | None:
        return FULL if random.Random(self.seed * 1_000_003 + step).random() < self.rate else None
