"""Each attention layer's input hidden states: what its q/k/v projections read, after the layer's input
norm (``input_layernorm`` on Llama / Qwen; the tensor kvpress's hooks call ``hidden_states``).

KVzap's surrogates score a token from its own such state (``policies/kvzap.py``), and KVzip+ divides
by its norm (``policies/kvzip.py``, in the second pass). Recorded only for a policy that asks, before
each attention layer of each prefill chunk (the adapter taps the attention module's input,
``adapter/attention_inputs.py``). The capture option says how much is held per token:

  1  its L2 norm only (KVzip+'s passes);
  2  the vector (float32), per attention layer ``ContextSignals.hidden_states`` [n, hidden];

and a policy that scores chunk by chunk (``ChunkScoring.hidden``: KVzap on one rank) holds neither:
each chunk's states are scored at once and let go, so a long context holds [kv_heads, n] scores per
layer (``ContextSignals.streamed_scores``), not n x hidden floats (a 32K context of an 8B model
would hold 16 GiB of them).

A recording that missed a layer or a chunk (a captured graph replayed past the tap) fails the
compaction with that reason; it never scores part of a context.
"""

from __future__ import annotations

import torch

from sglang_kvx.signals.base import ChunkScoring, Signal, register_signal

NORMS, VECTORS = 1, 2


class HiddenState:
    """Per attention layer, the chunks seen so far: (positions, norms, vectors or None, scores or None)."""

    def __init__(self, n: int, num_layers: int, option: int, scoring: ChunkScoring | None) -> None:
        self.n = n
        self.num_layers = num_layers
        self.vectors = option >= VECTORS and scoring is None
        self.scoring = scoring
        self.chunks: list[list[tuple[range, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]] = [
            [] for _ in range(num_layers)]

    def _covered(self, layer: int) -> range:
        """The positions layer ``layer``'s chunks cover, checked to follow each other."""
        chunks = self.chunks[layer]
        if not chunks:
            return range(0)
        for (a, *_), (b, *_) in zip(chunks, chunks[1:]):
            if a.stop != b.start:
                raise RuntimeError(f"sglang_kvx: attention layer {layer}'s input hidden states skip positions "
                                   f"{a.stop}-{b.start - 1} (a chunk was not recorded)")
        return range(chunks[0][0].start, chunks[-1][0].stop)

    def norms(self, layer: int) -> torch.Tensor:
        """||h|| of every recorded token of the layer, in position order: [t]."""
        self._covered(layer)
        if not self.chunks[layer]:
            raise RuntimeError(f"sglang_kvx: attention layer {layer}'s input hidden states were not recorded")
        return torch.cat([chunk[1] for chunk in self.chunks[layer]])

    def whole(self, layer: int, what: int) -> torch.Tensor:
        """The layer's vectors (what=2) or chunk scores (what=3) over the whole context, checked complete."""
        covered = self._covered(layer)
        if covered != range(self.n):
            raise RuntimeError(f"sglang_kvx: attention layer {layer}'s input hidden states cover positions "
                               f"{covered.start}-{covered.stop - 1} of a {self.n}-token context (a captured graph "
                               f"replayed past the tap, or a chunk was missed): not scored")
        return torch.cat([chunk[what] for chunk in self.chunks[layer]], dim=0 if what == 2 else -1)


@register_signal
class AttentionInputs(Signal):
    name = "hidden_states"
    field = "hidden_states"
    provides = "hidden_states"
    reads_attention_inputs = True

    def start(self, n: int, num_layers: int, option: int, setup) -> HiddenState:
        scoring = setup.chunk_scoring if setup.chunk_scoring is not None and setup.chunk_scoring.hidden else None
        return HiddenState(n, num_layers, option, scoring)

    def on_attention_input(self, state: HiddenState, layer: int, positions: range, hidden: torch.Tensor) -> None:
        h = hidden.float()
        norms = (h * h).sum(dim=-1).sqrt_()  # kept for KVzip+ even when scored: 4 bytes a token
        scores = state.scoring.hidden(layer, h) if state.scoring is not None else None
        state.chunks[layer].append((positions, norms, h.clone() if state.vectors else None, scores))

    def fill(self, state: HiddenState, signals) -> None:
        if state.scoring is not None:
            signals.streamed_scores = [state.whole(layer, 3) for layer in range(state.num_layers)]
        elif state.vectors:
            signals.put(self.field, [state.whole(layer, 2) for layer in range(state.num_layers)])
        else:
            signals.put(self.field, None)
