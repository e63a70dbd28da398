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

from sglang_kvx.decode.base import DecodeStep, register_decode_step


@register_decode_step("sigmoid-gate")
class SigmoidGateEviction(DecodeStep):
    real_options = ("tau",)
    needs: ClassVar[frozenset[str]] = frozenset({"learned_gates"})
    evicts_by_gate = True
    model_hint = "a gated checkpoint: weights/gated/*-gate"

    def __init__(self, *, tau: float = 0.0) -> None:
        if not 0.0 <= tau < 1.0:
            raise ValueError(f"tau must be in [0, 1), got {tau:g}")
        self.tau = tau

    def gate_threshold(self) -> float:
        return self.tau
