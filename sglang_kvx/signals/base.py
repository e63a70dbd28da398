"""What one prefill of a context exposes to a policy, and a signal as one registered unit.

Everything is per context (one sequence) and per attention layer, indexed in
attention-layer order (0 = the model's first full-attention layer). Tensors
are float32 on the device the prefill ran on. A policy reads only the fields
named in its ``needs``; the producer fills only what some policy asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

if TYPE_CHECKING:
    from sglang_kvx.ports import TensorParallel


class CaptureSpec:
    """What a parent's prefill must record for its policy and allocation: registered signal names
    (``Signal.name``) with their option (a count such as SnapKV's window, or 1 for "on"); keys and
    values are read from the pool afterwards. Union two specs with ``|`` (the larger option wins).
    ``CaptureSpec(window=16, column_sums=True)``."""

    __slots__ = ("options",)

    def __init__(self, **options: int | bool) -> None:
        for name, option in options.items():
            if isinstance(option, bool) or isinstance(option, int):
                if option < 0:
                    raise ValueError(f"capture option {name}={option} must be >= 0")
            else:
                raise TypeError(f"capture option {name}={option!r} must be an int or a bool")
        self.options: dict[str, int] = {name: int(option) for name, option in sorted(options.items()) if option}

    def __or__(self, other: "CaptureSpec") -> "CaptureSpec":
        merged = dict(self.options)
        for name, option in other.options.items():
            merged[name] = max(merged.get(name, 0), option)
        return CaptureSpec(**merged)

    def __contains__(self, name: str) -> bool:
        return name in self.options

    def __iter__(self):
        return iter(self.options)

    def get(self, name: str) -> int:
        """The option of signal ``name`` (0: not captured)."""
        return self.options.get(name, 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CaptureSpec) and self.options == other.options

    def __hash__(self) -> int:
        return hash(tuple(self.options.items()))

    def __repr__(self) -> str:
        return f"CaptureSpec({', '.join(f'{k}={v}' for k, v in self.options.items())})"

    @property
    def empty(self) -> bool:
        return not self.options


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
    """How a policy whose score of an entry reads only that token's own signals scores a prefill
    chunk while it runs: the recorder then holds each attention layer's scores instead of the
    signals. GateSight reads GDN signals (``gdn_window``, ``score``: of the GDN layers still to be
    read only the current chunk's are held); KVzap reads each attention layer's input hidden states
    (``hidden``: the chunk's hidden states are scored and let go)."""

    gdn_window: int = 0  # how many GDN layers before an attention layer its scores read
    # (attention layer, the chunk's signals of those GDN layers oldest first, positions, n) -> [kv_heads, t]
    score: Callable[[int, list[GDNLayerSignals], range, int], torch.Tensor] | None = None
    # (attention layer, the chunk's attention-input hidden states [t, hidden]) -> [kv_heads, t]
    hidden: Callable[[int, torch.Tensor], torch.Tensor] | None = None


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
    extra: what signals registered outside these fields produced (``Signal.field`` -> per layer),
        read as attributes like the fields above (``signals.<field>``).
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
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached when no field has the name: a registered signal's own field, None when not produced.
        extra = self.__dict__.get("extra")
        if extra is None or name.startswith("__"):
            raise AttributeError(name)
        if name in extra:
            return extra[name]
        if name in SIGNAL_FIELDS:
            return None
        raise AttributeError(f"ContextSignals has no signal {name!r} (no registered signal fills it)")

    def put(self, name: str, value: Any) -> None:
        """Set signal field ``name``: a declared field, or ``extra`` for a signal registered elsewhere."""
        if name in self.__dataclass_fields__:
            setattr(self, name, value)
        else:
            self.extra[name] = value

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


def gather_heads(signals: ContextSignals, spec: CaptureSpec, tp: "TensorParallel", total_kv_heads: int) -> None:
    """Under tensor parallelism: make the per-head signals every rank recorded for its own heads
    whole on every rank (each signal of ``spec`` gathers its own: ``Signal.gather``), so budgets and
    features are computed from the whole model, identically on all ranks; and note which KV heads
    this rank keeps entries for."""
    for name in spec:
        if get_signal(name).per_rank:
            get_signal(name).gather(signals, tp)
    signals.kv_heads = rank_kv_heads(total_kv_heads, tp.rank, tp.size)


class QueryChunk:
    """One prefill chunk of one parent row, seen right after attention layer ``layer`` ran on it (its
    KV is in the pool): what a query-reading signal accumulates from."""

    def __init__(self, layer: int, positions: range, scaling: float, queries: Callable[[], torch.Tensor],
                 keys: Callable[[], torch.Tensor], inv_freq: Callable[[], torch.Tensor]) -> None:
        self.layer = layer
        self.positions = positions  # the chunk's context positions
        self.scaling = scaling  # the layer's softmax scale
        self._queries, self._keys, self._inv_freq = queries, keys, inv_freq
        self._cache: dict[str, torch.Tensor] = {}

    def _once(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    @property
    def queries(self) -> torch.Tensor:
        """[t, q_heads, head_dim] float32, after RoPE (made once, on first read)."""
        return self._once("queries", self._queries)

    @property
    def keys(self) -> torch.Tensor:
        """[positions.stop, kv_heads, head_dim]: every key of the row up to the chunk's last, as cached."""
        return self._once("keys", self._keys)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's RoPE frequencies [rotary_dim / 2]."""
        return self._once("inv_freq", self._inv_freq)


@dataclass(frozen=True)
class ReferenceLayer:
    """One attention layer of a whole context as HF transformers computed it (the offline producer)."""

    queries: torch.Tensor  # [q_heads, n, head_dim] float32, after RoPE
    keys: torch.Tensor  # [kv_heads, n, head_dim] float32, after RoPE
    scaling: float
    inv_freq: Callable[[], torch.Tensor]


class Signal:
    """One signal a policy or an allocation can read, as one registered unit: its capture inside the
    served forward (hooks, called per parent row and prefill chunk), its accumulation over chunks (the
    per-row ``state``), what it puts into ``ContextSignals`` (``fill``), and its offline producer
    from an HF prefill (``reference``).

    ``name`` is what ``CaptureSpec`` and ``captures()`` call it; ``field`` the ``ContextSignals``
    attribute it fills; ``provides`` the model capability it answers (``KVPolicy.needs`` /
    allocation needs name these, e.g. "queries"; "" when only ``captures()`` asks for it). A hook
    that raises stops that parent's recording only (it stays uncompacted), never the forward.
    """

    name: ClassVar[str] = ""
    field: ClassVar[str] = ""
    provides: ClassVar[str] = ""
    reads_queries: ClassVar[bool] = False  # fed by ``on_queries`` with each chunk's queries
    # Its state grows and shrinks within a chunk (GDN chunk scoring): the recording's peak is taken after each layer.
    holds_chunks: ClassVar[bool] = False
    # Each tensor-parallel rank records its own heads: ``gather`` makes it whole (a collective call per rank).
    per_rank: ClassVar[bool] = False
    # Fed by ``on_attention_input`` with each attention layer's input hidden states (the adapter taps them only then).
    reads_attention_inputs: ClassVar[bool] = False

    def start(self, n: int, num_layers: int, option: int, setup: Any) -> Any:
        """The per-row state for an ``n``-token context (``option``: the spec's value for this signal;
        ``setup``: the recorder's ``RecordingSetup``)."""
        raise NotImplementedError

    def on_queries(self, state: Any, chunk: QueryChunk) -> None:
        """After an attention layer ran on one prefill chunk of the row."""

    def on_attention_layer(self, state: Any, layer: int, positions: range) -> None:
        """After attention layer ``layer`` ran on ``positions`` of the row (no query read)."""

    def on_attention_input(self, state: Any, layer: int, positions: range, hidden: torch.Tensor) -> None:
        """Before attention layer ``layer`` runs on ``positions`` of the row: its input hidden states
        [t, hidden] (after the layer's input norm: what the q/k/v projections read)."""

    def trim(self, state: Any, layer: int) -> None:
        """After attention layer ``layer`` (and the recording's peak taken): drop what no later layer reads."""

    def on_output_gate(self, state: Any, layer: int, gate: torch.Tensor) -> None:
        """An attention layer's output gate for the chunk's tokens: [t, q_heads, head_dim] (pre-sigmoid)."""

    def on_gdn(self, state: Any, layer_id: int, beta: torch.Tensor, g: torch.Tensor, v_norm: torch.Tensor) -> None:
        """A GDN layer's per-token write gate, log-decay and value norm for the chunk [t, Hv]."""

    def on_gdn_inputs(self, state: Any, layer: Any, mixed_qkv: torch.Tensor, rows: slice, a: torch.Tensor,
                      b: torch.Tensor) -> None:
        """Before a GDN layer runs on the GPU route: its module and inputs (``mixed_qkv[rows]``, ``a``, ``b``: the row's chunk)."""

    def fill(self, state: Any, signals: ContextSignals) -> None:
        """Put what ``state`` accumulated into ``signals`` (a parent seen whole)."""
        raise NotImplementedError

    def gather(self, signals: ContextSignals, tp: "TensorParallel") -> None:
        """Under tensor parallelism, make a per-rank signal whole (default: every rank already agrees)."""

    def reference(self, layer: ReferenceLayer, option: int) -> Any:
        """This signal's value for one attention layer, from HF's whole-context queries and keys (the
        offline producer; signals that read no queries are tapped in ``reference/signals.py``)."""
        raise NotImplementedError(f"signal {self.name!r} has no offline producer from queries and keys")


SIGNALS: dict[str, Signal] = {}
SIGNAL_FIELDS: set[str] = set()


def register_signal(cls: type[Signal]) -> type[Signal]:
    """Class decorator: ``@register_signal`` makes ``cls.name`` capturable (``CaptureSpec(name=...)``)."""
    if not cls.name or not cls.field:
        raise ValueError(f"signal {cls.__name__} needs a name and a ContextSignals field")
    if cls.name in SIGNALS and type(SIGNALS[cls.name]) is not cls:
        raise ValueError(f"signal {cls.name!r} is already registered")
    SIGNALS[cls.name] = cls()
    SIGNAL_FIELDS.add(cls.field)
    return cls


def get_signal(name: str) -> Signal:
    if name not in SIGNALS:
        raise KeyError(f"unknown signal {name!r}; registered: {', '.join(sorted(SIGNALS))}")
    return SIGNALS[name]


def capture_for(needs: frozenset[str]) -> CaptureSpec:
    """What to record for a policy or allocation reading the model capabilities ``needs``."""
    return CaptureSpec(**{signal.name: True for signal in SIGNALS.values() if signal.provides and signal.provides in needs})
