"""A second pass's signal: every query of the pass, per attention layer, with the layer's softmax
scale (``compact/second_pass.py`` folds them, with the keys of [context ; pass], into the policy's
totals: ``SecondPass.accumulate``). Never put into ``ContextSignals`` itself."""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import QueryChunk, Signal, register_signal


class PassQueriesState:
    def __init__(self) -> None:
        self.chunks: dict[int, list[torch.Tensor]] = {}  # attention layer -> chunks [t, Hq, D]
        self.scaling: dict[int, float] = {}

    def queries(self, layer: int) -> torch.Tensor:
        """Every query of the pass in attention layer ``layer``: [q_heads, m, head_dim]."""
        return torch.cat(self.chunks[layer]).transpose(0, 1)


@register_signal
class PassQueries(Signal):
    name = "pass_queries"
    field = "pass_queries"
    reads_queries = True

    def start(self, n: int, num_layers: int, option: int, setup) -> PassQueriesState:
        return PassQueriesState()

    def on_queries(self, state: PassQueriesState, chunk: QueryChunk) -> None:
        state.chunks.setdefault(chunk.layer, []).append(chunk.queries)
        state.scaling[chunk.layer] = chunk.scaling

    def fill(self, state: PassQueriesState, signals) -> None:
        pass  # read from the recording by the second pass, not scored from ContextSignals
