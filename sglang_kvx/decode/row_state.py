"""A decode step's own per-row state: what a step keeps for one running request beyond its span.

The runner (``serve/decoding.py``) keeps, for every request running a decode step, the span of the
current step and the positions every layer dropped; everything else a step needs per request --
gates, per-head budgets, the last committed hidden state, folds -- and its counters and report live in
an instance of the step's ``row_state`` class, made when the request enters its row:

  chose(span)            after each decode step's first run: the span the step committed to (None:
                         the first run's; steps that may re-run)
  after_step(row, seq_len)
                         after each decode step with ``seq_len`` keys
  summary(row)           what it did so far (the response's ``meta_info`` and ``/kvx/stats``, in the
                         list named ``report``); None: nothing to say
  outcome(row)           the response's report when the request ends (default: ``summary``)
  release(row)           the request leaves: free what it holds, add its figures to the totals
  after_run(outputs, i)  steps declaring ``forward_outputs``: what the forward the row keeps (a prefill
                         chunk, a decode step's committed run) produced, at batch index ``i``
  first_run_scores(states, index, outputs)
                         (a class method) steps that may re-run: each row's score of its first run,
                         every row of the class in the batch at once (``rerun_span``'s ``score``)

and, called by the attention backend one layer at a time (the backends name no step):

  visibility(layer, seq_len, keys_of, decode)
                         what the row reads in ``layer`` beyond its plain row and span: a
                         ``Visibility`` (a learned-gate threshold, a re-folded stretch, a per-head
                         key mask, whether it wants the layer's attention weights), or None
  after_attention(layer, seq_len, weights, keys_of, decode)
                         the layer ran: the attention its queries paid each key (when it asked)

Server-wide figures go in ``facts.totals`` under names the step class declares
(``DecodeStep.totals``), so the runtime and ``/kvx/stats`` list them without naming any step. A
method raising here ends its own request only (the runner contains it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

KeysOf = Callable[[int], Any]  # n -> the row's first n cached keys in this layer, [Hkv, n, D]

# What a step may read of each forward besides the logits (``DecodeStep.forward_outputs``).
FINAL_HIDDEN = "final_hidden"  # each row's final hidden state (the LM head's input) at its last position
INPUT_EMBEDDINGS = "input_embeddings"  # the input embedding of each row's last token (its embed_tokens row)
FORWARD_OUTPUTS = (FINAL_HIDDEN, INPUT_EMBEDDINGS)


@dataclass
class ForwardOutputs:
    """What one forward produced besides the logits, one row per batch row ([batch, hidden] each; None
    where no step of the batch asked)."""

    final_hidden: Any = None
    input_embeddings: Any = None


@dataclass
class Visibility:
    """What one row reads in one attention layer at this forward, beyond its plain row and its span
    (each backend applies the parts its mechanism supports and refuses the rest)."""

    gate_threshold: float = 0.0  # keys whose learned gate is below it are skipped (0: none)
    fold: Any = None  # a re-folded stretch (``compact.gate_fold.FoldedRow``) read instead of its positions
    head_mask: Any = None  # [Hkv, seq_len] bool: the keys each KV head reads (None: all)
    wants_attention: bool = False  # the layer's attention weights go to ``after_attention``


@dataclass
class RowFacts:
    """What a row state may use of the scheduler, the same for every row."""

    pool: Any  # ports.KVPool: rows' slots, bytes per entry, free()
    totals: dict[str, Any] = field(default_factory=dict)  # server-wide figures, by the names steps declare
    gates: Any = None  # learned-gate models: the gate of each pool cell, per buffer (torch.Tensor)
    fold_every: int = 64  # decode steps between re-folds of a row under learned-gate eviction
    model_path: str = ""  # the served checkpoint (its config: FLOPs ledgers)
    resources: dict[str, Any] = field(default_factory=dict)  # each step's ``load_resources``, by step name


class RowState:
    """The default: a step with no per-row state of its own (StreamingLLM, span schedules)."""

    report: ClassVar[str] = ""  # the /kvx/stats list running rows' summaries go to ("" = none)

    def __init__(self, step, request, facts: RowFacts) -> None:
        self.step = step
        self.request = request  # read live: SGLang moves its owned start when it caches the prompt
        self.facts = facts
        # Positions [start, end) of the row whose cells this state gave back to the pool itself (a
        # learned-gate fold): the runner must not free them again.
        self.freed: tuple[int, int] | None = None

    def chose(self, span) -> None:
        pass

    def after_step(self, row: int, seq_len: int) -> None:
        pass

    def summary(self, row: int) -> dict | None:
        return None

    def outcome(self, row: int) -> dict | None:
        return self.summary(row)

    def release(self, row: int) -> None:
        pass

    def visibility(self, layer: int, seq_len: int, keys_of: KeysOf, decode: bool) -> Visibility | None:
        return None

    def after_run(self, outputs: ForwardOutputs, index: int) -> None:
        pass

    @classmethod
    def first_run_scores(cls, states: list["RowState"], index: list[int], outputs: ForwardOutputs | None) -> list:
        """Each row's score of its decode step's first run (``index``: the rows' batch positions in
        ``outputs``, None when the batch's steps read nothing of the forward); None: no score."""
        return [None] * len(states)

    def after_attention(self, layer: int, seq_len: int, weights: Any, keys_of: KeysOf, decode: bool) -> None:
        pass

    @property
    def masks(self) -> bool:
        """Whether this state hides entries of its row by its own ``cells`` (its batches run eagerly)."""
        return False

    def head_cells(self, row: int, layer: int, seq_len: int) -> Any:
        """What each KV head reads in ``layer`` at a decode step with ``seq_len`` keys, before the current
        token, when it is not the plain row and span: per head a list of (attention layer of a buffer, KV
        head there, pool slots) in rank order (KVzap's per-head drops and folds); None: the plain row.
        The runner serves them as cells (``store.PrefixCells``) and reads the current token from the row."""
        return None

    def freed_positions(self, owned_len: int) -> Any:
        """Positions of the row (a [owned_len] bool tensor) whose slots this state gave back to the pool
        itself, one by one (KVzap: an entry every layer and KV head dropped); None: none. The runner frees
        the rest of the row's own slots when the request leaves."""
        return None

    def attention_input(self, layer: int, positions: range, hidden: Any) -> None:
        """Steps that ``reads_attention_inputs``: the input hidden states [t, hidden] of attention layer
        ``layer`` for the row's tokens at ``positions`` (a prefill chunk, or the decode step's one token)."""
