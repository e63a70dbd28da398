"""The gate allocation's and GateSight's signal on gated-attention models (Qwen3.5 / Qwen3-Next):
per attention layer, each query head's mean sigmoid output gate over the context
(``ContextSignals.output_gate``: [1, q_heads] from the server, which holds only the running sum; the
offline producer, ``reference/signals.py``, taps the projection and gives it per token, [n, q_heads])."""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import Signal, register_signal


@register_signal
class OutputGate(Signal):
    name = "output_gate"
    field = "output_gate"
    provides = "output_gate"
    per_rank = True

    def start(self, n: int, num_layers: int, option: int, setup) -> dict:
        # attention layer -> (per query head sum over the tokens so far, token count): the gate
        # allocation reads only the mean, so no per-token gate is held
        return {"num_layers": num_layers, "sums": {}}

    def on_output_gate(self, state: dict, layer: int, gate: torch.Tensor) -> None:
        # The gate may be a strided view into the fused projection (Qwen3.5); the sigmoid reads it
        # in place (a contiguous copy first costs ~1.5x at 4K on one core).
        chunk = torch.sigmoid(gate.float()).mean(dim=-1).sum(dim=0, dtype=torch.float64)  # [Hq]
        total, count = state["sums"].get(layer, (0.0, 0))
        state["sums"][layer] = (chunk + total, count + gate.shape[0])

    def fill(self, state: dict, signals) -> None:
        sums = state["sums"]
        if len(sums) != state["num_layers"]:
            raise RuntimeError("sglang_kvx: this model's attention layers reported no output gate")
        signals.put(self.field, [(total / count).float()[None] for total, count in (sums[i] for i in range(len(sums)))])

    def gather(self, signals, tp) -> None:
        if signals.output_gate is not None:  # each rank computed its own query heads
            signals.output_gate = [tp.all_gather(g.contiguous(), dim=1) for g in signals.output_gate]
