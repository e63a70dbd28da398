"""GateSight's signal on hybrid Gated-DeltaNet models: per GDN layer and token, the write gate beta,
the log-decay g and the value norm ||v|| (``ContextSignals.gdn``).

Captured two ways: our CPU GDN backend hands over what it computed anyway (``on_gdn``); on the GPU
route the recorder recomputes them from the layer's inputs (``recompute``, the causal conv
continued across prefill chunks). A policy that scores chunk by chunk (``ChunkScoring``: GateSight
on one rank) is scored inside the forward instead: at each attention layer, from the current
chunk's signals of the GDN layers before it; a GDN layer's chunk is dropped once no later attention
layer reads it. What a long context holds is then its scores plus one chunk's signals of a few
layers, not every layer's signals of every token (then ``ContextSignals.streamed_scores`` is set
and ``gdn`` stays empty)."""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_kvx.ops.gdn import causal_conv1d, gdn_gates
from sglang_kvx.signals.base import ChunkScoring, GDNLayerSignals, Signal, gdn_layers_before, register_signal


class GDNLayout:
    """Which GDN layers an attention layer's chunk scores read, and when a GDN layer's chunk can go."""

    def __init__(self, gdn_layer_ids: Sequence[int], attention_layer_ids: Sequence[int], window: int) -> None:
        self.gdn_layer_ids = list(gdn_layer_ids)
        self.before = gdn_layers_before(gdn_layer_ids, attention_layer_ids)
        self.window = window
        self.read = {gdn_layer_ids[i] for b in self.before for i in range(max(0, b - window), b)}

    def reads(self, layer: int) -> list[int]:
        """The GDN layer ids attention layer ``layer`` reads, oldest first."""
        b = self.before[layer]
        return self.gdn_layer_ids[max(0, b - self.window) : b]

    def done_after(self, layer: int) -> list[int]:
        """The GDN layer ids no attention layer after ``layer`` reads."""
        if layer + 1 == len(self.before):
            return self.gdn_layer_ids
        return self.gdn_layer_ids[: max(0, self.before[layer + 1] - self.window)]


class GDNState:
    def __init__(self, n: int, gdn_layer_ids: list[int], attention_layer_ids: list[int],
                 chunk_scoring: ChunkScoring | None) -> None:
        self.n = n
        self.gdn_layer_ids = gdn_layer_ids
        self.attention_layer_ids = attention_layer_ids
        if chunk_scoring is not None and chunk_scoring.score is None:
            chunk_scoring = None  # it scores from other signals (KVzap's hidden states): GDN signals are kept whole
        self.scoring = chunk_scoring
        self.layout = (GDNLayout(gdn_layer_ids, attention_layer_ids, chunk_scoring.gdn_window)
                       if chunk_scoring is not None else None)
        self.chunks: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # GDN layer id -> chunks of (beta, g, v_norm)
        self.scores: dict[int, list[torch.Tensor]] = {}  # attention layer -> chunks [kv_heads, t]
        self.conv_tail: dict[int, torch.Tensor] = {}  # GPU route: the causal conv's last inputs per GDN layer


@register_signal
class GDNSignals(Signal):
    name = "gdn"
    field = "gdn"
    provides = "gdn"
    holds_chunks = True
    per_rank = True

    def start(self, n: int, num_layers: int, option: int, setup) -> GDNState:
        return GDNState(n, list(setup.gdn_layer_ids), list(setup.attention_layer_ids), setup.chunk_scoring)

    def on_gdn(self, state: GDNState, layer_id: int, beta: torch.Tensor, g: torch.Tensor, v_norm: torch.Tensor) -> None:
        chunk = (beta.float(), g.float(), v_norm.float())
        if state.layout is None:
            state.chunks.setdefault(layer_id, []).append(chunk)
        elif layer_id in state.layout.read:
            state.chunks[layer_id] = [chunk]  # only the current chunk: earlier ones are scored already

    def on_attention_layer(self, state: GDNState, layer: int, positions: range) -> None:
        """Chunk scoring: attention layer ``layer`` ran on ``positions``; score them from the GDN layers
        before it (``trim`` then drops the GDN chunks no later attention layer reads)."""
        if state.layout is None:
            return
        gdn = []
        for layer_id in state.layout.reads(layer):
            chunk = state.chunks.get(layer_id)
            if not chunk or chunk[-1][0].shape[0] != len(positions):
                raise RuntimeError(f"sglang_kvx: GDN layer {layer_id}'s signals for positions {positions.start}-"
                                   f"{positions.stop - 1} were not recorded before attention layer {layer}")
            gdn.append(GDNLayerSignals(*chunk[-1]))
        state.scores.setdefault(layer, []).append(state.scoring.score(layer, gdn, positions, state.n))

    def trim(self, state: GDNState, layer: int) -> None:
        if state.layout is not None:
            for layer_id in state.layout.done_after(layer):
                state.chunks.pop(layer_id, None)

    def on_gdn_inputs(self, state: GDNState, layer, mixed_qkv: torch.Tensor, rows: slice, a: torch.Tensor,
                      b: torch.Tensor) -> None:
        """GPU route: (beta, g, ||v||) of the row's chunk recomputed from the layer's inputs, v after the
        causal conv as the delta rule sees it (a later chunk continues the conv from this one's last inputs)."""
        if not isinstance(mixed_qkv, torch.Tensor):
            raise NotImplementedError("sglang_kvx: GDN signal capture needs the unfused mixed_qkv projection")
        v_channels = slice(layer.q_dim + layer.k_dim, layer.q_dim + layer.k_dim + layer.v_dim)
        weight = layer.conv_weights[v_channels]
        bias = layer.bias[v_channels] if layer.bias is not None else None
        g, beta = gdn_gates(layer.A_log, a, b, layer.dt_bias)
        v, state.conv_tail[layer.layer_id] = causal_conv1d(
            mixed_qkv[rows, v_channels].float(), weight, bias, state.conv_tail.get(layer.layer_id), layer.activation)
        v_norm = v.reshape(v.shape[0], layer.num_v_heads, layer.head_v_dim).norm(dim=-1)
        self.on_gdn(state, layer.layer_id, beta, g, v_norm)

    def fill(self, state: GDNState, signals) -> None:
        num_layers = len(state.attention_layer_ids)
        if state.layout is not None:
            streamed = [torch.cat(state.scores.get(i, []) or [torch.empty(0)], dim=-1) for i in range(num_layers)]
            if any(s.shape[-1] != state.n for s in streamed):
                raise RuntimeError("sglang_kvx: the prefill's chunk scores do not cover the whole context")
            signals.streamed_scores = streamed
            signals.gdn_layer_of_attention = list(state.layout.before)
            return
        signals.gdn = [GDNLayerSignals(*(torch.cat([chunk[k] for chunk in state.chunks[layer_id]]) for k in range(3)))
                       for layer_id in state.gdn_layer_ids]
        signals.gdn_layer_of_attention = gdn_layers_before(state.gdn_layer_ids, state.attention_layer_ids)

    def gather(self, signals, tp) -> None:
        for layer in signals.gdn:  # each rank computed its own value heads
            layer.beta, layer.g, layer.v_norm = (tp.all_gather(t.contiguous(), dim=1) for t in (layer.beta, layer.g, layer.v_norm))
