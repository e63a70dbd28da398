"""A finished parent becomes a compacted context: store hit, second pass, or compaction now.

``Runtime.before_release`` hands each finished parent here. The work is contained: an exception
leaves the context uncompacted with the reason in ``/kvx/stats`` and the request's outcome, and the
scheduler goes on serving everyone else.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from sglang_kvx.compact.compactor import Compactor, NothingFreed
from sglang_kvx.compact.second_pass import SecondPassRunner
from sglang_kvx.policies import get_policy
from sglang_kvx.ports import KVPool, Request, TensorParallel
from sglang_kvx.serve.request_state import RequestState
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.signals import CaptureSpec, ContextSignals, gather_heads, get_signal, rank_kv_heads
from sglang_kvx.signals.recorder import SignalRecorder
from sglang_kvx.store import ContextStore

logger = logging.getLogger(__name__)

MIN_COMPACTED_TOKENS = 2  # a parent with fewer tokens outside its protected prefix is served uncompacted


def _summary(context) -> dict:
    n = context.n
    return {"context_tokens": n, "slots": context.num_slots, "kept_fraction": round(context.num_slots / n, 6) if n else 0.0,
            "policy": context.settings.policy, "keep_fraction": context.settings.keep_fraction}


class ParentCompaction:
    """Compacts finished parents; counts the ones it leaves uncompacted, by reason."""

    def __init__(self, pool: KVPool, store: ContextStore, compactor: Compactor, recorder: SignalRecorder,
                 second_pass: SecondPassRunner, capture_spec: Callable[[CompactionSettings], CaptureSpec],
                 failed: Callable[[str], None], tp: TensorParallel | None, num_kv_heads_total: int) -> None:
        self.pool = pool
        self.store = store
        self.compactor = compactor
        self.recorder = recorder
        self.second_pass = second_pass
        self.capture_spec = capture_spec
        self.failed = failed
        self.tp = tp  # --tp-size > 1: per-head signals are gathered from every rank before scoring
        if tp is not None:  # a pass weighting its query heads by their o_proj slices (KVzip+) needs the rank's
            second_pass.kv_heads = rank_kv_heads(num_kv_heads_total, tp.rank, tp.size)
        self.num_kv_heads_total = num_kv_heads_total
        self.skipped_no_room = 0
        self.degenerate = 0  # parents whose settings keep no entry
        self.skipped_keeps_all = 0  # parents whose kept entries, in whole pages, fill the whole context
        self.incomplete_recordings = 0  # parents whose recording missed layers (never compacted from it)

    def contained(self, work: Callable[[], None], request: Request) -> None:
        try:
            work()
        except Exception as exc:  # one bad context must not stop the scheduler serving everyone else
            self.recorder.take(request.row)
            self.failed(f"{type(exc).__name__}: {exc}")
            if request.state is not None:
                request.state.outcome = {"compacted": False, "reason": "compaction failed inside the server (see /kvx/stats)"}
            logger.exception("sglang_kvx: compaction of a %d-token context failed; it stays uncompacted",
                             len(request.input_ids))

    def compact(self, request: Request, state: RequestState) -> None:
        """The finished parent ``request``: reuse a stored copy, start its policy's second pass, or compact it now."""
        settings = state.settings
        stored = self.store.get(request.input_ids, settings)
        if stored is not None:
            self.recorder.take(request.row)
            request.keep_out_of_tree()  # the compacted copy already serves this context
            state.outcome = {"compacted": True, "already_stored": True, **_summary(stored)}
            return
        if get_policy(settings.policy).second_pass:
            if not self.second_pass.start(request, settings, state.fields.tenant):
                self.skipped_no_room += 1
                state.outcome = {"compacted": False, "reason": f"no room in the pool to hold the context for {settings.policy}'s passes"}
            else:
                state.outcome = {"compacted": False, "pending": f"{settings.policy}'s passes run first; see /kvx/stats"}
            return
        recording = self.recorder.take(request.row)
        if recording is not None and (why := recording.incomplete()) is not None:
            self.incomplete_recordings += 1
            self.failed(why)
            state.outcome = {"compacted": False, "reason": why}
            logger.warning("sglang_kvx: a %d-token parent stays uncompacted: %s", len(request.input_ids), why)
            return
        n = len(request.input_ids)
        if n - settings.protected_prefix_len < MIN_COMPACTED_TOKENS:
            state.outcome = {"compacted": False, "reason": f"a context of {n} tokens is too short to compact"}
            return  # served and cached as an ordinary request
        context_slots = self.pool.row(request.row, n)
        try:
            context = self.compactor.compact(
                tuple(int(t) for t in request.input_ids), context_slots, settings,
                take_slots=lambda count: self._rank_slots(request, context_slots, count),
                fill_signals=lambda signals: self._fill_signals(signals, recording, settings),
                gdn_snapshot=self.pool.snapshot_state(request) if self.pool.has_state else None,
                timings={"capture_s": recording.seconds if recording is not None else 0.0,  # inside the prefill
                         "recorded_signal_bytes": recording.peak_nbytes() if recording is not None else 0},
            )
        except NothingFreed as why:
            self.skipped_keeps_all += 1
            state.outcome = {"compacted": False, "reason": str(why)}
            return
        if context is None:
            self.skipped_no_room += 1
            state.outcome = {"compacted": False, "reason": "no room in the pool for the compacted slots"}
            return
        if context.num_slots == 0:  # keep_fraction rounded every budget to zero: nothing to serve children from
            self.degenerate += 1
            state.outcome = {"compacted": False, "reason": "keep_fraction keeps no entry of this context"}
            return
        context.tenant = state.fields.tenant
        self.store.add(context)
        request.keep_out_of_tree()  # SGLang frees every other slot of the full context
        state.outcome = {"compacted": True, **_summary(context)}

    def _fill_signals(self, signals: ContextSignals, recording, settings: CompactionSettings) -> None:
        """What the prefill recorded, into ``signals``; under tensor parallelism the per-head signals
        of every rank, gathered (all ranks compact the same parent at the same point, so each
        makes the same collective calls; a recording that failed on any rank fails on all)."""
        error = None
        try:
            if recording is not None:
                recording.fill(signals)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agreed
            error = exc
        spec = self.capture_spec(settings)
        if self.tp is not None and any(get_signal(name).per_rank for name in spec):
            if not self.tp.all_agree(error is None):
                raise error or RuntimeError("sglang_kvx: another tensor-parallel rank failed to record this context")
            gather_heads(signals, spec, self.tp, self.num_kv_heads_total)
        if error is not None:
            raise error
        if self.tp is not None and signals.kv_heads is None:  # which heads this rank keeps (KVzap slices its scores)
            signals.kv_heads = rank_kv_heads(self.num_kv_heads_total, self.tp.rank, self.tp.size)

    def _rank_slots(self, request: Request, context_slots: torch.Tensor, count: int) -> torch.Tensor | None:
        """Slots for the compacted context. Prefer the parent's own: the copy gathers the kept entries
        into the first S slots the parent owns (everything is read before it writes), so compaction
        needs no pool slots beyond the prefill's. Fresh slots only when the parent owns too few (most
        of its context was a prefix-cache hit)."""
        owned_start = request.owned_from
        if len(context_slots) - owned_start >= count:
            slots = context_slots[owned_start : owned_start + count].clone()
            request.owned_from = owned_start + count  # SGLang frees the row past it: keep these out
            return slots
        return self.pool.alloc(count)
