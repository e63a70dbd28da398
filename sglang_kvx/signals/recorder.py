"""Recording what a policy reads from inside a parent's prefill, chunk by chunk.

One ``Recording`` per parent row holds what its ``CaptureSpec`` asks for: the last queries of the
context (SnapKV), per-key column sums of attention (H2O), query statistics (TriAttention), beta /
g / ||v|| per GDN layer and output gates per attention layer (GateSight), every query of a KVzip
reconstruction pass. The ``SignalRecorder`` is called by the adapter from inside SGLang's forward
with plain tensors and a ``Batch`` view; the policy maths lives in the policy files.

A policy that scores chunk by chunk (``ChunkScoring``: GateSight on one rank) is scored inside
the forward instead: at each attention layer, from the current chunk's signals of the GDN layers
before it; a GDN layer's chunk is dropped once no later attention layer reads it. What a long
context holds is then its scores plus one chunk's signals of a few layers, not every layer's
signals of every token.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from sglang_kvx.ops.gdn import causal_conv1d, gdn_gates
from sglang_kvx.signals.column_sums import add_column_sums
from sglang_kvx.signals.query_statistics import combine_query_statistics, query_statistics
from sglang_kvx.ports import Batch, KVPool, Segment
from sglang_kvx.signals import CaptureSpec, ChunkScoring, ContextSignals, GDNLayerSignals, gdn_layers_before

logger = logging.getLogger(__name__)


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


class Recording:
    """What one parent's prefill (or one KVzip pass) recorded so far."""

    def __init__(self, n: int, num_layers: int, spec: CaptureSpec,
                 chunk_scoring: tuple[ChunkScoring, GDNLayout] | None = None) -> None:
        self.n = n
        self.spec = spec
        self.chunk_scoring = chunk_scoring  # scored inside the prefill, chunk by chunk (GateSight)
        self.scores: dict[int, list[torch.Tensor]] = {}  # attention layer -> chunks [kv_heads, t]
        self.peak_bytes = 0  # the most this recording held at once (checked where chunk scoring peaks)
        self.window_queries: list[torch.Tensor | None] = [None] * num_layers  # [w, Hq, D]
        self.column_sums: list[torch.Tensor | None] = [None] * num_layers  # [Hq, n]
        # attention layer -> (per query head sum over the tokens so far, token count): the gate
        # allocation reads only the mean, so no per-token gate is held
        self.gates: dict[int, tuple[torch.Tensor, int]] = {}
        self.gdn: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # GDN layer id -> chunks of (beta, g, v_norm)
        self.query_stats: dict[int, list[Any]] = {}  # attention layer -> per-chunk QueryStatistics
        self.conv_tail: dict[int, torch.Tensor] = {}
        self.pass_queries: dict[int, list[torch.Tensor]] = {}  # KVzip pass: attention layer -> chunks [t, Hq, D]
        self.scaling: dict[int, float] = {}
        self.seconds = 0.0  # spent recording inside the forward
        self.failed: str | None = None  # why recording stopped (the context then stays uncompacted)

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
        def size(value: Any) -> int:
            if isinstance(value, torch.Tensor):
                return value.numel() * value.element_size()
            if isinstance(value, dict):
                return sum(size(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return sum(size(v) for v in value)
            if hasattr(value, "__dict__"):  # e.g. TriAttention's QueryStatistics
                return sum(size(v) for v in vars(value).values())
            return 0

        return sum(size(getattr(self, name)) for name in
                   ("window_queries", "column_sums", "gates", "gdn", "query_stats", "conv_tail", "pass_queries", "scores"))

    def peak_nbytes(self) -> int:
        """The most this recording held at once: its size now, or more in the middle of a chunk."""
        return max(self.peak_bytes, self.nbytes())

    @staticmethod
    def add(per_key: dict, key: int, value) -> None:
        per_key.setdefault(key, []).append(value)

    def add_gdn(self, layer_id: int, chunk: tuple[torch.Tensor, ...]) -> None:
        if self.chunk_scoring is None:
            self.add(self.gdn, layer_id, chunk)
        elif layer_id in self.chunk_scoring[1].read:
            self.gdn[layer_id] = [chunk]  # only the current chunk: earlier ones are scored already

    def score_chunk(self, layer: int, positions: range) -> None:
        """Attention layer ``layer`` ran on ``positions``: score them from the GDN layers before it, then
        drop the GDN chunks no later attention layer reads."""
        scoring, layout = self.chunk_scoring
        gdn = []
        for layer_id in layout.reads(layer):
            chunk = self.gdn.get(layer_id)
            if not chunk or chunk[-1][0].shape[0] != len(positions):
                raise RuntimeError(f"sglang_kvx: GDN layer {layer_id}'s signals for positions {positions.start}-"
                                   f"{positions.stop - 1} were not recorded before attention layer {layer}")
            gdn.append(GDNLayerSignals(*chunk[-1]))
        self.add(self.scores, layer, scoring.score(layer, gdn, positions, self.n))
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        for layer_id in layout.done_after(layer):
            self.gdn.pop(layer_id, None)

    def add_window(self, layer: int, queries: torch.Tensor) -> None:
        # Chunked prefill: a later chunk's queries push the earlier ones out of the window.
        previous = self.window_queries[layer]
        joined = queries if previous is None else torch.cat([previous, queries])
        self.window_queries[layer] = joined[-self.spec.window :]

    def fill(self, signals: ContextSignals, gdn_layer_ids: list[int], attention_layer_ids: list[int]) -> None:
        """Put everything recorded into ``signals`` (a parent seen whole: n tokens per signal)."""
        if self.failed is not None:
            raise RuntimeError(f"sglang_kvx: recording this context's signals failed ({self.failed})")
        num_layers = len(attention_layer_ids)
        if self.spec.window:
            signals.window_queries = [w.transpose(0, 1) for w in self.window_queries]
        if self.spec.column_sums:
            signals.attention_column_sums = list(self.column_sums)
        if self.spec.output_gate:
            if len(self.gates) != num_layers:
                raise RuntimeError("sglang_kvx: this model's attention layers reported no output gate")
            signals.output_gate = [(total / count).float()[None] for total, count in (self.gates[i] for i in range(num_layers))]
        if self.spec.gdn and self.chunk_scoring is not None:
            signals.streamed_scores = [torch.cat(self.scores.get(i, []) or [torch.empty(0)], dim=-1) for i in range(num_layers)]
            if any(s.shape[-1] != self.n for s in signals.streamed_scores):
                raise RuntimeError("sglang_kvx: the prefill's chunk scores do not cover the whole context")
            signals.gdn_layer_of_attention = list(self.chunk_scoring[1].before)
        elif self.spec.gdn:
            signals.gdn = [
                GDNLayerSignals(*(torch.cat([chunk[k] for chunk in self.gdn[layer_id]]) for k in range(3)))
                for layer_id in gdn_layer_ids
            ]
            signals.gdn_layer_of_attention = gdn_layers_before(gdn_layer_ids, attention_layer_ids)
        if self.spec.query_statistics:
            signals.query_statistics = [combine_query_statistics(self.query_stats[i]) for i in range(num_layers)]


class SignalRecorder:
    """The recordings of one scheduler, by request row."""

    def __init__(self, pool: KVPool, num_q_heads: int, rope_inv_freq, gdn_layer_ids: Sequence[int] = (),
                 attention_layer_ids: Sequence[int] = ()) -> None:
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
            layout = None
            if chunk_scoring is not None and spec.gdn:
                layout = (chunk_scoring, GDNLayout(self.gdn_layer_ids, self.attention_layer_ids, chunk_scoring.gdn_window))
            self.recordings[row] = Recording(n, self.pool.num_layers, spec, layout)

    def take(self, row: int) -> Recording | None:
        return self.recordings.pop(row, None)

    def clear(self) -> None:
        self.recordings.clear()

    def _recorded(self, batch: Batch) -> list[tuple[Segment, Recording]]:
        if not self.recordings or not batch.is_extend:
            return []
        return [(seg, self.recordings[seg.row]) for seg in batch.segments
                if seg.row in self.recordings and self.recordings[seg.row].failed is None]

    def attention(self, layer: int, q: torch.Tensor, batch: Batch, num_q_heads: int, head_dim: int, scaling: float) -> None:
        """After attention layer ``layer`` ran (its KV is in the pool): what query-reading policies need,
        and the chunk's scores of a policy that scores chunk by chunk."""
        for seg, rec in self._recorded(batch):
            if rec.chunk_scoring is not None:
                with rec.timed():
                    rec.score_chunk(layer, range(seg.prefix_len, seg.prefix_len + seg.length))
            if not rec.spec.reads_queries:
                continue
            with rec.timed():
                queries = q[seg.start : seg.start + seg.length].reshape(-1, num_q_heads, head_dim).float()
                if rec.spec.window:
                    rec.add_window(layer, queries)
                if rec.spec.pass_queries:
                    rec.add(rec.pass_queries, layer, queries)
                    rec.scaling[layer] = scaling
                if rec.spec.query_statistics:
                    positions = seg.prefix_len + torch.arange(queries.shape[0], device=queries.device)
                    rec.add(rec.query_stats, layer,
                            query_statistics(queries.transpose(0, 1), positions, self._rope_inv_freq()))
                if rec.spec.column_sums:
                    seq_len = seg.prefix_len + seg.length
                    keys = self.pool.read_keys(layer, self.pool.row(seg.row, seq_len))
                    if rec.column_sums[layer] is None:  # per KV head: a group's size less to hold
                        rec.column_sums[layer] = torch.zeros(keys.shape[1], rec.n, device=queries.device)
                    add_column_sums(rec.column_sums[layer], queries, keys, scaling, seg.prefix_len)

    def gdn_inputs(self, layer, batch: Batch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Before a GDN layer runs (GPU route): recompute beta, g and ||v|| (after the causal conv, as the
        delta rule sees v) from the layer's inputs, for every parent token in the batch."""
        recorded = [(seg, rec) for seg, rec in self._recorded(batch) if rec.spec.gdn]
        if not recorded:
            return
        if not isinstance(mixed_qkv, torch.Tensor):
            raise NotImplementedError("sglang_kvx: GDN signal capture needs the unfused mixed_qkv projection")
        v_channels = slice(layer.q_dim + layer.k_dim, layer.q_dim + layer.k_dim + layer.v_dim)
        weight = layer.conv_weights[v_channels]
        bias = layer.bias[v_channels] if layer.bias is not None else None
        for seg, rec in recorded:
            with rec.timed():
                start, length = seg.start, seg.length
                g, beta = gdn_gates(layer.A_log, a[start : start + length], b[start : start + length], layer.dt_bias)
                # A later prefill chunk continues the conv from the previous chunk's last inputs.
                tail = rec.conv_tail.get(layer.layer_id)
                v, rec.conv_tail[layer.layer_id] = causal_conv1d(
                    mixed_qkv[start : start + length, v_channels].float(), weight, bias, tail, layer.activation
                )
                v_norm = v.reshape(length, layer.num_v_heads, layer.head_v_dim).norm(dim=-1)
                rec.add_gdn(layer.layer_id, (beta.float(), g.float(), v_norm.float()))

    def gdn_signals(self, layer_id: int, row: int, beta: torch.Tensor, g: torch.Tensor, v: torch.Tensor) -> None:
        """What our CPU GDN backend computed anyway for one row of an extend (no recomputation)."""
        rec = self.recordings.get(row)
        if rec is None or not rec.spec.gdn or rec.failed is not None:
            return
        with rec.timed():
            v = v.float()
            # sqrt(sum v^2): ~1.5x faster than Tensor.norm on CPU, equal to float32 rounding.
            rec.add_gdn(layer_id, (beta.float(), g.float(), (v * v).sum(dim=-1).sqrt_()))

    def output_gate(self, layer: int, gate: torch.Tensor, batch: Batch, num_q_heads: int) -> None:
        """An attention layer's output gate for the parents' tokens: mean sigmoid per query head
        (``num_q_heads``: the heads this rank computes)."""
        for seg, rec in self._recorded(batch):
            if rec.spec.output_gate:
                with rec.timed():
                    per_head = gate[seg.start : seg.start + seg.length].reshape(seg.length, num_q_heads, -1)
                    # The gate may be a strided view into the fused projection (Qwen3.5); the sigmoid reads it
                    # in place (a contiguous copy first costs ~1.5x at 4K on one core).
                    chunk = torch.sigmoid(per_head.float()).mean(dim=-1).sum(dim=0, dtype=torch.float64)  # [Hq]
                    total, count = rec.gates.get(layer, (0.0, 0))
                    rec.gates[layer] = (chunk + total, count + seg.length)
