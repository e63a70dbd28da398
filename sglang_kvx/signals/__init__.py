"""What one prefill of a context exposes to a policy.

Everything is per context (one sequence) and per attention layer, indexed in
attention-layer order (0 = the model's first full-attention layer). Tensors
are float32 on the device the prefill ran on. A policy reads only the fields
named in its ``needs``; the producer fills only what some policy asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from sglang_kvx.ports import TensorParallel


@dataclass(frozen=True)
class CaptureSpec:
    """What a parent's prefill must record for its policy and allocation (the rest, keys and values,
    is read from the pool afterwards). Union two specs with ``|``."""

    window: int = 0  # last queries of the context per attention layer (SnapKV's observation window)
    column_sums: bool = False  # every query's attention summed per key (H2O)
    query_statistics: bool = False  # TriAttention's query centres and magnitudes
    gdn: bool = False  # beta, g, ||v|| per GDN layer (GateSight)
    output_gate: bool = False  # mean sigmoid output gate per attention layer (GateSight budgets)
    pass_queries: bool = False  # every query of a KVzip reconstruction pass

    @classmethod
    def for_signals(cls, names: frozenset[str]) -> "CaptureSpec":
        """The spec for signals named as in ``KVPolicy.needs`` / allocation needs."""
        return cls(query_statistics="queries" in names, gdn="gdn" in names, output_gate="output_gate" in names)

    def __or__(self, other: "CaptureSpec") -> "CaptureSpec":
        return replace(
            self,
            window=max(self.window, other.window),
            **{name: getattr(self, name) or getattr(other, name)
               for name in ("column_sums", "query_statistics", "gdn", "output_gate", "pass_queries")},
        )

    @property
    def reads_queries(self) -> bool:
        return bool(self.window or self.column_sums or self.query_statistics or self.pass_queries)

    @property
    def empty(self) -> bool:
        return self == CaptureSpec()


@dataclass
class GDNLayerSignals:
    """Per token and value head of one Gated-DeltaNet layer (all [n, Hv])."""

    beta: torch.Tensor  # write gate, sigmoid(b)
    g: torch.Tensor  # log-decay, <= 0
    v_norm: torch.Tensor  # ||v_t|| after the causal conv

    @property
    def effective_write(self) -> torch.Tensor:
        return self.beta * self.v_norm


@dataclass(frozen=True)
class ChunkScoring:
    """How a policy whose score of an entry reads only that token's own GDN signals (GateSight)
    scores a prefill chunk while it runs: the recorder then holds each attention layer's scores,
    and of the GDN signals only the current chunk's, of the layers still to be read."""

    gdn_window: int  # how many GDN layers before an attention layer its scores read
    # (attention layer, the chunk's signals of those GDN layers oldest first, positions, n) -> [kv_heads, t]
    score: Callable[[int, list[GDNLayerSignals], range, int], torch.Tensor]


@dataclass
class QueryStatistics:
    """TriAttention's query centre and magnitudes for one attention layer, from the context's own queries.

    Every query is first un-rotated to position 0 (RoPE inverted with its own position), so the
    statistics describe the position-free (pre-RoPE) queries. Layout follows the model's RoPE
    (rotate-half): of the first rotary_dim = 2 * len(inv_freq) dims, dims f and f + rotary_dim/2
    form frequency pair f (one complex number, rotated by angle position * inv_freq[f]); the
    remaining head_dim - rotary_dim dims are not rotated (partial rotary).

    center: [q_heads, head_dim], mean un-rotated query E[q].
    magnitude: [q_heads, rotary_dim/2 + head_dim - rotary_dim], mean norm E[|q_f|] of each
        frequency pair, then of each non-rotated dim.
    inv_freq: [rotary_dim/2], RoPE angular frequency of each pair (radians per position).
    count: how many queries (per head) the means cover.
    """

    center: torch.Tensor
    magnitude: torch.Tensor
    inv_freq: torch.Tensor
    count: int

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]


@dataclass
class ContextSignals:
    """Signals of one prefilled context of ``n`` tokens.

    keys / values: per attention layer [kv_heads, n, head_dim]; keys after RoPE, as cached.
    window_queries: per attention layer [q_heads, w, head_dim], the queries (after RoPE) of the
        last w context tokens: SnapKV's observation window.
    attention_column_sums: per attention layer [q_heads, n] (the server keeps [kv_heads, n], summed
        over each KV group, which is all H2O reads), sum over every context query of its
        softmax attention to each key (H2O's accumulated attention).
    output_gate: per attention layer [t, q_heads], mean |sigmoid(gate)| of the gated attention output
        over its head dim: per token (t = n) from the offline producers; the server holds only each
        query head's mean over the context's tokens (t = 1), all the gate allocation reads.
    query_statistics: per attention layer, the QueryStatistics of all n context queries
        (TriAttention); sglang_kvx.policies.triattention.query_statistics makes one from the
        post-RoPE queries and their positions.
    reconstruction_attention: per attention layer [kv_heads, n], KVzip's score: the max softmax
        attention each entry receives from the queries of a second pass that repeats the context
        (max over the query heads of its KV group and over the reconstruction queries); made by
        sglang_kvx.policies.kvzip.accumulate_reconstruction_attention.
    gdn: per GDN layer, in model order; gdn_layer_of_attention[l] = how many GDN layers precede
        attention layer l (its signals are gdn[:gdn_layer_of_attention[l]]).
    streamed_scores: per attention layer [kv_heads, n], scores a ChunkScoring policy computed
        chunk by chunk inside the prefill (then ``gdn`` stays empty: it was never held whole).
    protected_prefix_len: the first tokens every policy keeps, outside the budget.
    """

    n: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor] | None = None
    attention_column_sums: list[torch.Tensor] | None = None
    output_gate: list[torch.Tensor] | None = None
    query_statistics: list[QueryStatistics] | None = None
    reconstruction_attention: list[torch.Tensor] | None = None
    gdn: list[GDNLayerSignals] = field(default_factory=list)
    gdn_layer_of_attention: list[int] = field(default_factory=list)
    streamed_scores: list[torch.Tensor] | None = None
    protected_prefix_len: int = 0
    # Under tensor parallelism: the model's KV heads [start, end) this rank holds (None: all of them).
    kv_heads: tuple[int, int] | None = None
    rope_theta: float | None = None
    device: torch.device | None = None  # where scores go; None = the keys' device

    @property
    def score_device(self) -> torch.device:
        """The device of the context's tensors, without reading a layer's keys when it is known."""
        return self.device if self.device is not None else self.keys[0].device

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads


def gdn_layers_before(gdn_layer_ids, attention_layer_ids) -> list[int]:
    """Per attention layer, how many GDN layers precede it in the model (``gdn_layer_of_attention``)."""
    return [sum(g < a for g in gdn_layer_ids) for a in attention_layer_ids]


def rank_kv_heads(total: int, rank: int, size: int) -> tuple[int, int]:
    """The model's KV heads [start, end) that tensor-parallel rank ``rank`` of ``size`` holds:
    contiguous equal shares, or one replicated head per ``size // total`` ranks when there are
    fewer heads than ranks (SGLang's QKVParallelLinear)."""
    if total < 1 or size < 1 or not 0 <= rank < size:
        raise ValueError(f"no KV heads for rank {rank} of {size} with {total} heads")
    if total >= size:
        if total % size:
            raise ValueError(f"{total} KV heads do not split over {size} ranks")
        local = total // size
        return rank * local, (rank + 1) * local
    head = rank // (size // total)
    return head, head + 1


def gather_heads(signals: ContextSignals, tp: "TensorParallel", total_kv_heads: int) -> None:
    """Under tensor parallelism: make the per-head signals every rank recorded for its own heads
    (output gates per query head, GDN beta / g / ||v|| per value head) whole on every rank, so
    budgets and features are computed from the whole model, identically on all ranks; and note
    which KV heads this rank keeps entries for. One all-gather per signal tensor."""
    if signals.output_gate is not None:
        signals.output_gate = [tp.all_gather(g.contiguous(), dim=1) for g in signals.output_gate]
    for layer in signals.gdn:
        layer.beta, layer.g, layer.v_norm = (tp.all_gather(t.contiguous(), dim=1) for t in (layer.beta, layer.g, layer.v_norm))
    signals.kv_heads = rank_kv_heads(total_kv_heads, tp.rank, tp.size)
