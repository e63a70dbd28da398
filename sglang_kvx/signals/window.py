"""SnapKV's signal: the queries of the context's last ``window`` tokens per attention layer
(``ContextSignals.window_queries``, [q_heads, w, head_dim] after RoPE)."""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import QueryChunk, ReferenceLayer, Signal, register_signal


class WindowState:
    def __init__(self, num_layers: int, window: int) -> None:
        self.window = window
        self.queries: list[torch.Tensor | None] = [None] * num_layers  # [w, Hq, D]


@register_signal
class WindowQueries(Signal):
    name = "window"  # option: how many last queries
    field = "window_queries"
    reads_queries = True

    def start(self, n: int, num_layers: int, option: int, setup) -> WindowState:
        return WindowState(num_layers, option)

    def on_queries(self, state: WindowState, chunk: QueryChunk) -> None:
        # Chunked prefill: a later chunk's queries push the earlier ones out of the window.
        previous = state.queries[chunk.layer]
        joined = chunk.queries if previous is None else torch.cat([previous, chunk.queries])
        state.queries[chunk.layer] = joined[-state.window :]

    def fill(self, state: WindowState, signals) -> None:
        signals.put(self.field, [w.transpose(0, 1) for w in state.queries])

    def reference(self, layer: ReferenceLayer, option: int) -> torch.Tensor:
        n = layer.queries.shape[1]
        return layer.queries[:, max(0, n - option):].clone()
