"""Running decode steps (``sglang_kvx.decode``) for the rows of one scheduler.

Per decode forward the adapter calls: ``begin`` (each row's span for this step), the forward,
``reruns`` (rows whose step asks to run again with another span: the adapter restores their
recurrent state and runs the forward again), then ``end`` (what each row drops for good; slots
no layer keeps any more go back to the pool). Attention reads ``hidden`` per row and layer: one
interval [start, end) of positions a row does not read in that layer this step.

What a row's step reads of the forward besides the logits (``DecodeStep.forward_outputs``: final
hidden states, input embeddings) the adapter captures for the batch when one of its rows asks
(``forward_outputs``) and hands over: the first run's to ``reruns``, where each step's row states score
it (``RowState.first_run_scores``), the kept run's (or a prefill chunk's) to ``after_run``. The runner
names no step; each step's server-wide resources come from ``step_resources``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from sglang_kvx.decode import DECODE_STEPS, DecodeStep, Span
from sglang_kvx.decode.base import StepUnavailable
from sglang_kvx.decode.row_state import ForwardOutputs, RowFacts, RowState, Visibility
from sglang_kvx.ports import KVPool, Request
from sglang_kvx.store import CompactedContext, PrefixCells

logger = logging.getLogger(__name__)


def _union(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    if a[1] <= a[0]:
        return b
    if b[1] <= b[0] or (b[0] >= a[0] and b[1] <= a[1]):
        return a
    if max(a[0], b[0]) > min(a[1], b[1]):
        raise NotImplementedError(f"decode steps: two separate hidden intervals {a} and {b} in one layer")
    return (min(a[0], b[0]), max(a[1], b[1]))


@dataclass
class DecodeRow:
    """The runner's part of a running request's decode step: the step, its span this step, what each
    layer dropped; the step's own state (``own``: its ``row_state``) holds everything else."""

    step: DecodeStep
    own: RowState
    num_layers: int
    steps: int = 0  # decode steps started
    span: Span = field(default_factory=Span)
    dropped: list[tuple[int, int]] = field(default_factory=list)  # per layer, positions gone for good
    freed: tuple[int, int] = (0, 0)  # positions whose slots went back to the pool
    failed: bool = False  # its step raised: the request is aborted, nothing of the step runs again

    def __post_init__(self) -> None:
        self.dropped = [(0, 0)] * self.num_layers

    @property
    def request(self) -> Request:
        return self.own.request

    def hidden(self, layer: int, seq_len: int) -> tuple[int, int]:
        return _union(self.dropped[layer], self.span.hidden(seq_len))


BatchKeysOf = Callable[[int, int], torch.Tensor]  # (batch index, n) -> that row's first n keys [Hkv, n, D]


def step_resources(config: Any, device: torch.device | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Every registered step's server-wide resources (``DecodeStep.load_resources``), and why this server
    cannot run the steps that are unavailable (their requests are refused with it)."""
    resources, unavailable = {}, {}
    for name, step_class in DECODE_STEPS.items():
        try:
            resources[name] = step_class.load_resources(config, device)
        except StepUnavailable as why:
            unavailable[name] = str(why)
    return resources, unavailable


class DecodeRunner:
    def __init__(self, pool: KVPool, facts: RowFacts | None = None, unavailable: dict[str, str] | None = None) -> None:
        self.pool = pool
        self.facts = facts or RowFacts(pool)  # what every row state may use; its totals are the steps' figures
        self.unavailable = dict(unavailable or {})  # step name -> why this server cannot run it
        for step_class in DECODE_STEPS.values():  # every registered step's figures, at zero until it runs
            for name, zero in step_class.totals(pool.num_layers).items():
                self.facts.totals.setdefault(name, zero)
        self.rows: dict[int, DecodeRow] = {}
        self.freed_slots = 0  # slots returned to the pool while their requests ran
        self.rerun_count = 0
        self.rerun_forwards = 0  # forwards re-run ...
        self.partial_reruns = 0  # ... of which over only the rows that asked (a sub-batch)
        self.failures = 0
        self.last_error: str | None = None

    @property
    def totals(self) -> dict[str, Any]:
        return self.facts.totals

    def reports(self) -> dict[str, list[dict]]:
        """Each running row's summary, in its step's report list (every step's list, empty when none runs)."""
        out: dict[str, list[dict]] = {cls.row_state.report: [] for cls in DECODE_STEPS.values() if cls.row_state.report}
        for row, state in self.rows.items():
            if state.own.report and (summary := self._contain(state, lambda: state.own.summary(row))) is not None:
                out[state.own.report].append(summary)
        return out

    def __bool__(self) -> bool:
        return bool(self.rows)

    def admit(self, row: int, step: DecodeStep, request: Request) -> None:
        """A request enters its row with its decode step (again for each prefill chunk: its state is
        kept). A state left by another request -- one that ended without running a decode step -- is replaced."""
        state = self.rows.get(row)
        if state is None or state.request.rid != request.rid:
            self.rows[row] = DecodeRow(step=step, own=step.row_state(step, request, self.facts),
                                       num_layers=self.pool.num_layers)

    # --- one decode forward ------------------------------------------------------------

    def begin(self, rows: list[int]) -> list[int]:
        """Set each decode row's first span for this step; the rows that may ask for a re-run."""
        may_rerun = []
        for row in rows:
            state = self._live(row)
            if state is None:
                continue
            state.steps += 1
            try:
                state.span = state.step.span(state.steps)
                if state.step.may_rerun(state.steps):
                    may_rerun.append(row)
            except Exception as exc:
                self._fail(state, exc)
        return may_rerun

    def forward_outputs(self, rows: list[int]) -> frozenset[str]:
        """What the steps of ``rows`` read of this forward besides the logits (``DecodeStep.forward_outputs``)."""
        wanted: frozenset[str] = frozenset()
        for row in rows:
            if (state := self._live(row)) is not None:
                wanted |= state.step.forward_outputs
        return wanted

    def after_run(self, rows: list[int], outputs: ForwardOutputs | None) -> None:
        """The forward the batch keeps (a prefill chunk, a decode step's committed run) produced ``outputs``:
        each row whose step reads them gets its own."""
        for i, row in enumerate(rows):
            state = self._live(row)
            if outputs is not None and state is not None and state.step.forward_outputs:
                self._contain(state, lambda: state.own.after_run(outputs, i))

    def reruns(self, rows: list[int], batch_rows: list[int] | None = None,
               outputs: ForwardOutputs | None = None) -> list[int]:
        """Rows whose step asks to run again with another span (set now), from each row state's score of the
        first run (``outputs``: what it produced, in ``batch_rows`` order)."""
        scores = _first_run_scores(self, rows, batch_rows or rows, outputs)
        again = []
        for row in rows:
            state = self._live(row)
            if state is None:
                continue
            try:
                span = state.step.rerun_span(state.steps, state.span, scores.get(row))
                state.own.chose(span)
            except Exception as exc:
                self._fail(state, exc)
                continue
            if span is not None and span != state.span:
                state.span = span
                again.append(row)
        self.rerun_count += len(again)
        return again

    def count_rerun(self, partial: bool) -> None:
        self.rerun_forwards += 1
        self.partial_reruns += partial

    # --- what each row reads, asked by the attention backend one layer at a time ------------

    def visibility(self, layer: int, rows: list[int], seq_lens: list[int], keys_of: BatchKeysOf,
                   decode: bool) -> dict[int, Visibility]:
        """Batch index -> what the row's own state changes of what it reads in ``layer`` (rows whose
        state changes nothing are absent); the backend calls ``after_attention`` with them after the layer."""
        seen = {}
        for i, row in enumerate(rows):
            state = self._live(row)
            if state is not None:
                visible = self._contain(state, lambda: state.own.visibility(layer, seq_lens[i], partial(keys_of, i), decode))
                if visible is not None:
                    seen[i] = visible
        return seen

    def after_attention(self, layer: int, rows: list[int], seq_lens: list[int], seen: dict[int, Visibility],
                        weights: dict[int, torch.Tensor | None], keys_of: BatchKeysOf, decode: bool) -> None:
        """``layer`` ran: each row in ``seen`` gets the attention weights it asked for."""
        for i in seen:
            state = self._live(rows[i])
            if state is not None:
                self._contain(state, lambda: state.own.after_attention(layer, seq_lens[i], weights.get(i),
                                                                       partial(keys_of, i), decode))

    def _contain(self, state: DecodeRow, work: Callable):
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - contained to the row's request
            self._fail(state, exc)
            return None

    def outcome(self, row: int) -> dict | None:
        """What a row's step did, for its response when it ends (None: nothing to say)."""
        state = self.rows.get(row)
        return self._contain(state, lambda: state.own.outcome(row)) if state is not None else None

    def end(self, rows: list[int], seq_lens: list[int]) -> None:
        """After the step: record what each row drops; free the slots no layer reads any more."""
        for row, seq_len in zip(rows, seq_lens):
            state = self._live(row)
            if state is None:
                continue
            try:
                dropped = state.step.dropped(seq_len, state.num_layers)
                if dropped is not None and len(dropped) != state.num_layers:
                    raise ValueError(f"dropped() gave {len(dropped)} intervals for {state.num_layers} attention layers")
            except Exception as exc:
                self._fail(state, exc)
                continue
            if dropped is None:
                try:
                    state.own.after_step(row, seq_len)
                except Exception as exc:
                    self._fail(state, exc)
                    continue
                if state.own.freed is not None:  # cells its own state gave back (a fold): not freed again
                    state.freed = state.own.freed
                continue
            state.dropped = [_union(old, new) for old, new in zip(state.dropped, dropped)]
            # Positions every layer dropped, and that are this request's own (not the prefix cache's).
            start = max(max(d[0] for d in state.dropped), state.request.owned_from)
            end = min(d[1] for d in state.dropped)
            if end <= start:
                continue
            freed_start, freed_end = state.freed
            if freed_end > freed_start and freed_start != start:
                raise NotImplementedError("decode steps: freed positions must grow from one start")
            new_start = max(start, freed_end) if freed_end > freed_start else start
            if end > new_start:
                self.pool.free(self.pool.row(row, end)[new_start:end])
                self.freed_slots += end - new_start
                state.freed = (start, end)

    def before_first_step(self, rows: list[int]) -> bool:
        """Whether one of ``rows`` runs a decode step that has not begun its first step yet (its prefill just ran)."""
        return any((state := self._live(row)) is not None and state.steps == 0 for row in rows)

    def _live(self, row: int) -> DecodeRow | None:
        state = self.rows.get(row)
        return None if state is None or state.failed else state

    def _fail(self, state: DecodeRow, exc: Exception) -> None:
        """A step's own code raised: that request ends with an error, the batch and server go on.
        What it dropped stays hidden (its slots may be gone); it reads the rest in full until it leaves."""
        state.failed = True
        state.span = Span()
        self.failures += 1
        self.last_error = f"{state.step.name}: {type(exc).__name__}: {str(exc)[:200]}"
        logger.exception("sglang_kvx: decode step %s failed; its request is aborted", state.step.name)
        state.request.abort(f"sglang_kvx: decode step {state.step.name!r} failed inside the server (internal error)", 500)

    def masked_rows(self, layer: int, rows: list[int], seq_lens: list[int],
                    contexts: dict[int, tuple[CompactedContext, PrefixCells | None]] | None = None) -> dict[int, PrefixCells]:
        """Batch index -> what this layer reads, for decode rows that hide something this step.
        ``contexts``: batch index -> (the compacted context a child reads, its cells in this layer)."""
        return _masked_rows(self, layer, rows, seq_lens, contexts)

    # --- leaving -----------------------------------------------------------------------

    def release(self, row: int, owned_len: int) -> int | None:
        """The row's request leaves: free its own live slots here (some were freed already) and
        return the new owned start for SGLang (nothing left for it to free), or None when the row
        ran no decode step that freed anything (SGLang frees as usual)."""
        state = self.rows.pop(row, None)
        if state is not None:
            self._contain(state, lambda: state.own.release(row))
        own_freed = state.own.freed_positions(owned_len) if state is not None else None  # [owned_len] bool or None
        if state is None or (state.freed[1] <= state.freed[0] and own_freed is None):
            return None
        owned_from = state.request.owned_from
        slots = self.pool.row(row, owned_len)
        keep = torch.ones(owned_len, dtype=torch.bool) if own_freed is None else ~own_freed.cpu()
        keep[:owned_from] = False
        keep[state.freed[0] : state.freed[1]] = False
        live = slots[keep.to(slots.device)]
        if live.numel():
            self.pool.free(live)
        return owned_len

    def forget_all(self) -> None:
        self.rows.clear()


def _first_run_scores(runner: DecodeRunner, rows: list[int], batch_rows: list[int],
                      outputs: ForwardOutputs | None) -> dict[int, float | None]:
    """Each row's score of its first run: the rows of one row-state class in one call (a step scoring with a
    model batches it); a class that raises fails its rows."""
    by_class: dict[type, list[tuple[int, DecodeRow]]] = {}
    for row in rows:
        if (state := runner._live(row)) is not None:
            by_class.setdefault(type(state.own), []).append((row, state))
    scores: dict[int, float | None] = {}
    for state_class, members in by_class.items():
        try:
            found = state_class.first_run_scores([state.own for _, state in members],
                                                 [batch_rows.index(row) for row, _ in members], outputs)
        except Exception as exc:  # noqa: BLE001 - contained to these rows' requests
            for _, state in members:
                runner._fail(state, exc)
            continue
        scores.update((row, score) for (row, _), score in zip(members, found))
    return scores


def _masked_rows(runner: DecodeRunner, layer: int, rows: list[int], seq_lens: list[int],
                 contexts: dict[int, tuple[CompactedContext, PrefixCells | None]] | None) -> dict[int, PrefixCells]:
    """``DecodeRunner.masked_rows``: a child's span over its compacted context, a row state's own cells
    (per-head masks: KVzap's drops), else the row's one hidden interval."""
    found = {}
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        state = runner.rows.get(row)
        if state is None:
            continue
        if contexts and i in contexts:
            context, cells = contexts[i]
            local = child_local_cells(state.span, context, layer, cells, runner.pool.layer_id(layer),
                                      runner.pool.row(row, seq_len), seq_len)
            if local is not None:
                found[i] = local
            continue
        heads = None if state.failed else runner._contain(state, lambda: state.own.head_cells(row, layer, seq_len))
        if heads is not None:  # each KV head reads its own cells; the current token comes from the row
            found[i] = PrefixCells(num_slots=seq_len - 1, own=0, head_own=(0,) * len(heads), head_borrowed=tuple(
                tuple((runner.pool.layer_id(buf), h, at) for buf, h, at in pieces) for pieces in heads))
            continue
        start, end = state.hidden(layer, seq_len)
        if end > start:
            found[i] = PrefixCells(num_slots=end, own=start)
    return found


def child_local_cells(span: Span, context: CompactedContext, layer: int, cells: PrefixCells | None, layer_id: int,
                      row_slots: torch.Tensor, seq_len: int) -> PrefixCells | None:
    """A child's span over one attention layer's own keys: the K_l entries that layer kept of the
    compacted context (rank order = ascending positions), then the child's own tokens. The first
    ``sinks`` and the last ``window`` of them are read (as the HF oracle's compacted cache has them);
    None when the span hides nothing there. The result reads the current token from the row and
    every other visible key as a cell (attention does not depend on key order)."""
    if cells is not None and cells.head_own is not None:  # refused in admission: never here
        raise NotImplementedError("a decode step over a context compacted with per-head budgets")
    num_slots, kept = context.num_slots, context.kept_per_layer[layer]
    total = kept + seq_len - num_slots  # the layer's keys, the current token last
    start, end = span.hidden(total)
    if end <= start:
        return None
    device = row_slots.device
    visible = torch.cat([torch.arange(min(start, total - 1), device=device),
                         torch.arange(max(end, 0), total - 1, device=device)])  # the current token stays in the row
    in_row = min(kept, num_slots)
    own = visible[(visible < in_row) | (visible >= kept)]
    own_slots = row_slots[torch.where(own < in_row, own, own - kept + num_slots)]
    pieces = [(layer_id, own_slots)] if own.numel() else []
    borrowed = visible[(visible >= in_row) & (visible < kept)] - in_row  # ranks in other layers' buffers
    if borrowed.numel():
        offset = 0
        for other, slots in cells.borrowed:
            take = borrowed[(borrowed >= offset) & (borrowed < offset + slots.numel())] - offset
            if take.numel():
                pieces.append((other, slots[take.to(slots.device)]))
            offset += slots.numel()
    return PrefixCells(num_slots=seq_len - 1, own=0, borrowed=tuple(pieces))


# --- attention layers' input hidden states, for the steps that read them (DecodeRunner is at its size limit) ---


def wants_attention_inputs(runner: DecodeRunner) -> bool:
    """Whether a running row's step reads attention layers' input hidden states (the adapter taps them only then)."""
    return any(state.step.reads_attention_inputs and not state.failed for state in runner.rows.values())


def hand_attention_inputs(runner: DecodeRunner, layer: int, hidden: torch.Tensor, batch) -> None:
    """Before attention layer ``layer`` runs: each reading row's tokens' input hidden states (a prefill
    chunk's, or its decode token's) go to its row state."""
    if batch.is_decode:
        pieces = [(row, range(n - 1, n), i, i + 1) for i, (row, n) in enumerate(zip(batch.rows, batch.seq_lens))]
    elif batch.is_extend:
        pieces = [(seg.row, range(seg.prefix_len, seg.prefix_len + seg.length), seg.start, seg.start + seg.length)
                  for seg in batch.segments]
    else:
        return
    for row, positions, a, b in pieces:
        state = runner._live(row)
        if state is not None and state.step.reads_attention_inputs:
            runner._contain(state, lambda: state.own.attention_input(layer, positions, hidden[a:b]))
