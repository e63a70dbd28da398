"""Recording what a policy reads from inside a parent's prefill, chunk by chunk.

One ``Recording`` per parent row holds one state per signal its ``CaptureSpec`` names; each signal
is a registered unit (``signals.base.Signal``: its hooks, its accumulation, what it fills). The
``SignalRecorder`` is called by the adapter from inside SGLang's forward with plain tensors and a
``Batch`` view, and hands each tap to the signals of the rows it concerns: after an attention layer
(the chunk's queries, read once and only if some signal reads them), an output gate, a GDN layer.

A recording counts the tokens each tapped layer handed over against the tokens its row prefilled
(``expect``, told once per forward batch from outside the forward): when a forward ran without the
plugin's hooks (a captured graph's replay), some layers saw fewer, and the context is left uncompacted
with that reason (``Recording.incomplete``) instead of being compacted from partial signals.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

import sglang_kvx.signals  # noqa: F401 - registers the signals the package ships
from sglang_kvx.ports import Batch, KVPool, Segment
from sglang_kvx.signals.base import CaptureSpec, ChunkScoring, ContextSignals, QueryChunk, Signal, get_signal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordingSetup:
    """What a signal's state may need of the model beyond the context's length."""

    gdn_layer_ids: Sequence[int]
    attention_layer_ids: Sequence[int]
    chunk_scoring: ChunkScoring | None = None  # a policy scoring GDN signals chunk by chunk (GateSight)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor inside ``value``: a tensor, or dicts / lists / tuples / objects of them
    (a signal's state, TriAttention's QueryStatistics, a GDN state snapshot of the adapter's shape)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(tensor_bytes(v) for v in vars(value).values())
    return 0


class IncompleteRecording(RuntimeError):
    """A recording some layers did not see whole: its context is never compacted from it."""


# The taps a recording's signals are fed by, and which of them every recording uses.
ATTENTION, ATTENTION_INPUT, OUTPUT_GATE, GDN = "attention", "attention input", "output gate", "GDN"


def _taps(signals: dict[str, Signal]) -> set[str]:
    taps = {ATTENTION}  # every signal is told of every attention layer (on_attention_layer)
    for signal in signals.values():
        kind = type(signal)
        if kind.on_gdn is not Signal.on_gdn or kind.on_gdn_inputs is not Signal.on_gdn_inputs:
            taps.add(GDN)
        if kind.on_output_gate is not Signal.on_output_gate:
            taps.add(OUTPUT_GATE)
        if signal.reads_attention_inputs:
            taps.add(ATTENTION_INPUT)
    return taps


class Recording:
    """What one parent's prefill (or one second pass) recorded so far: a state per signal."""

    def __init__(self, n: int, num_layers: int, spec: CaptureSpec, setup: RecordingSetup) -> None:
        self.n = n
        self.spec = spec
        self.signals: dict[str, Signal] = {name: get_signal(name) for name in spec}
        self.states: dict[str, Any] = {name: signal.start(n, num_layers, spec.get(name), setup)
                                       for name, signal in self.signals.items()}
        self.reads_queries = any(signal.reads_queries for signal in self.signals.values())
        self.reads_attention_inputs = any(signal.reads_attention_inputs for signal in self.signals.values())
        self.holds_chunks = any(signal.holds_chunks for signal in self.signals.values())
        self.peak_bytes = 0  # the most this recording held at once (checked where chunk scoring peaks)
        self.seconds = 0.0  # spent recording inside the forward
        self.failed: str | None = None  # why recording stopped (the context then stays uncompacted)
        self.num_layers = num_layers
        self.gdn_layer_ids = list(setup.gdn_layer_ids)
        self.taps = _taps(self.signals)
        self.expected = 0  # tokens its row ran through the model so far (``SignalRecorder.expect``)
        self.seen: dict[tuple[str, int], int] = {}  # (tap, layer) -> tokens handed over there

    def saw(self, tap: str, layer: int, tokens: int) -> None:
        self.seen[(tap, layer)] = self.seen.get((tap, layer), 0) + tokens

    def incomplete(self) -> str | None:
        """Why this recording cannot be trusted whole (None: every tapped layer saw every token its row ran)."""
        for tap in sorted(self.taps):
            layers = self.gdn_layer_ids if tap == GDN else range(self.num_layers)
            whole = sum(self.seen.get((tap, layer), 0) == self.expected for layer in layers)
            if whole < len(layers):
                return (f"the prefill handed its {tap} signals over whole in {whole} of {len(layers)} layers for the "
                        f"{self.expected} tokens it ran (a forward ran without the plugin's hooks, e.g. a captured "
                        f"graph's replay); the context stays uncompacted rather than compacted from partial signals")
        return None

    def state(self, name: str) -> Any:
        return self.states[name]

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Time one piece of recording; an exception stops this recording only, never the forward."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:  # contained to this parent: its compaction reports it
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.exception("sglang_kvx: recording a parent's signals failed; it will stay uncompacted")
        self.seconds += time.perf_counter() - t0

    def nbytes(self) -> int:
        """Bytes of every tensor this recording holds (what a parent costs beside the pool until it is
        compacted; it only grows while the prefill runs, so at compaction this is its peak)."""
        return tensor_bytes(self.states)

    def peak_nbytes(self) -> int:
        """The most this recording held at once: its size now, or more in the middle of a chunk."""
        return max(self.peak_bytes, self.nbytes())

    def fill(self, signals: ContextSignals) -> None:
        """Put everything recorded into ``signals`` (a parent seen whole: n tokens per signal)."""
        if self.failed is not None:
            raise RuntimeError(f"sglang_kvx: recording this context's signals failed ({self.failed})")
        if (why := self.incomplete()) is not None:
            raise IncompleteRecording(f"sglang_kvx: {why}")
        for name, signal in self.signals.items():
            signal.fill(self.states[name], signals)


class SignalRecorder:
    """The recordings of one scheduler, by request row."""

    def __init__(self, pool: KVPool, num_q_heads: int, rope_inv_freq: Callable[[], torch.Tensor],
                 gdn_layer_ids: Sequence[int] = (), attention_layer_ids: Sequence[int] = ()) -> None:
        self.pool = pool
        self.num_q_heads = num_q_heads
        self._rope_inv_freq = rope_inv_freq  # () -> the model's RoPE frequencies (TriAttention only)
        self.gdn_layer_ids = list(gdn_layer_ids)
        self.attention_layer_ids = list(attention_layer_ids)
        self.recordings: dict[int, Recording] = {}

    def __bool__(self) -> bool:
        return bool(self.recordings)

    def start(self, row: int, n: int, spec: CaptureSpec, chunk_scoring: ChunkScoring | None = None) -> None:
        """Record what ``spec`` names for the n-token context in ``row``; with ``chunk_scoring`` (a GDN
        policy that scores per token) its scores are computed chunk by chunk inside the prefill."""
        if not spec.empty and row not in self.recordings:
            setup = RecordingSetup(self.gdn_layer_ids, self.attention_layer_ids, chunk_scoring)
            self.recordings[row] = Recording(n, self.pool.num_layers, spec, setup)

    def take(self, row: int) -> Recording | None:
        return self.recordings.pop(row, None)

    def clear(self) -> None:
        self.recordings.clear()

    def expect(self, batch: Batch) -> None:
        """A forward batch is about to run (told from outside the forward): each recorded row's tokens in it."""
        if self.recordings and batch.is_extend:
            for seg in batch.segments:
                if (rec := self.recordings.get(seg.row)) is not None:
                    rec.expected += seg.length

    def _recorded(self, batch: Batch) -> list[tuple[Segment, Recording]]:
        if not self.recordings or not batch.is_extend:
            return []
        return [(seg, self.recordings[seg.row]) for seg in batch.segments
                if seg.row in self.recordings and self.recordings[seg.row].failed is None]

    def attention(self, layer: int, q: torch.Tensor, batch: Batch, num_q_heads: int, head_dim: int, scaling: float) -> None:
        """After attention layer ``layer`` ran (its KV is in the pool): each recorded row's signals see the chunk."""
        for seg, rec in self._recorded(batch):
            positions = range(seg.prefix_len, seg.prefix_len + seg.length)
            rec.saw(ATTENTION, layer, seg.length)
            with rec.timed():
                for name, signal in rec.signals.items():
                    signal.on_attention_layer(rec.states[name], layer, positions)
                if rec.reads_queries:
                    chunk = QueryChunk(
                        layer, positions, scaling,
                        queries=lambda seg=seg: q[seg.start : seg.start + seg.length].reshape(-1, num_q_heads, head_dim).float(),
                        keys=lambda seg=seg: self.pool.read_keys(layer, self.pool.row(seg.row, seg.prefix_len + seg.length)),
                        inv_freq=self._rope_inv_freq)
                    for name, signal in rec.signals.items():
                        if signal.reads_queries:
                            signal.on_queries(rec.states[name], chunk)
                if rec.holds_chunks:  # at its largest: this layer's scores added, nothing dropped yet
                    rec.peak_bytes = max(rec.peak_bytes, rec.nbytes())
                    for name, signal in rec.signals.items():
                        signal.trim(rec.states[name], layer)

    @property
    def wants_attention_inputs(self) -> bool:
        """Whether some recording reads attention layers' input hidden states (the adapter taps them only then)."""
        return any(rec.reads_attention_inputs for rec in self.recordings.values())

    def attention_input(self, layer: int, hidden: torch.Tensor, batch: Batch) -> None:
        """Before attention layer ``layer`` runs: its input hidden states [tokens, hidden] for the whole batch."""
        for seg, rec in self._recorded(batch):
            if not rec.reads_attention_inputs:
                continue
            positions = range(seg.prefix_len, seg.prefix_len + seg.length)
            rec.saw(ATTENTION_INPUT, layer, seg.length)
            with rec.timed():
                for name, signal in rec.signals.items():
                    if signal.reads_attention_inputs:
                        signal.on_attention_input(rec.states[name], layer, positions, hidden[seg.start : seg.start + seg.length])

    def gdn_inputs(self, layer, batch: Batch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Before a GDN layer runs (GPU route): its inputs for every parent token in the batch."""
        for seg, rec in self._recorded(batch):
            rows = slice(seg.start, seg.start + seg.length)
            rec.saw(GDN, layer.layer_id, seg.length)
            with rec.timed():
                for name, signal in rec.signals.items():
                    signal.on_gdn_inputs(rec.states[name], layer, mixed_qkv, rows, a[rows], b[rows])

    def gdn_signals(self, layer_id: int, row: int, beta: torch.Tensor, g: torch.Tensor, v: torch.Tensor) -> None:
        """What our CPU GDN backend computed anyway for one row of an extend (no recomputation)."""
        rec = self.recordings.get(row)
        if rec is None or rec.failed is not None:
            return
        rec.saw(GDN, layer_id, int(beta.shape[0]))
        with rec.timed():
            v_norm = None
            for name, signal in rec.signals.items():
                if type(signal).on_gdn is not Signal.on_gdn:
                    if v_norm is None:  # sqrt(sum v^2): ~1.5x faster than Tensor.norm on CPU, equal to float32 rounding
                        v = v.float()
                        v_norm = (v * v).sum(dim=-1).sqrt_()
                    signal.on_gdn(rec.states[name], layer_id, beta, g, v_norm)

    def output_gate(self, layer: int, gate: torch.Tensor, batch: Batch, num_q_heads: int) -> None:
        """An attention layer's output gate for the parents' tokens (``num_q_heads``: the heads this rank computes)."""
        for seg, rec in self._recorded(batch):
            rec.saw(OUTPUT_GATE, layer, seg.length)
            with rec.timed():
                per_head = gate[seg.start : seg.start + seg.length].reshape(seg.length, num_q_heads, -1)
                for name, signal in rec.signals.items():
                    signal.on_output_gate(rec.states[name], layer, per_head)
