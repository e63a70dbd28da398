"""The extension inside one SGLang scheduler: admission, recording, compaction and second passes, wired.

The adapter (``sglang_kvx.adapter``) calls these few methods from SGLang's scheduler with views of
its objects; each concern lives in its own module:
  admission   serve/admission.py    parents, children, room, a child's prefix and positions
  recording   signals/recorder.py   what a policy reads from inside the prefill
  compaction  compact/compactor.py  read -> score -> allocate -> select -> fold -> gather -> store
  parents     serve/parent_compaction.py  a finished parent: store hit, second pass or compaction, contained
  second pass compact/second_pass.py  a policy's further forwards over its context (KVzip's), then the compactor
Any exception in the extension's own work on one request or context is contained to it: the
context stays uncompacted with the reason in ``/kvx/stats``, and the scheduler goes on.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch

from sglang_kvx.compact.compactor import Compactor
from sglang_kvx.compact.second_pass import SecondPassRunner
from sglang_kvx.config import KvxConfig, KvxConfigError, make_policy
from sglang_kvx.decode.row_state import RowFacts
from sglang_kvx.policies import KVPolicy, get_policy
from sglang_kvx.allocate import allocation_needs
from sglang_kvx.ports import KVPool, Request, RoundBudget, TensorParallel
from sglang_kvx.serve.admission import Admission
from sglang_kvx.serve.plans import CHILD as PLAN_CHILD, REFUSE, RESTORE, WAIT_PASSES, WAIT_REPEAT
from sglang_kvx.serve.report import runtime_counts, runtime_stats
from sglang_kvx.serve.decoding import DecodeRunner, step_resources
from sglang_kvx.serve.parent_compaction import ParentCompaction
from sglang_kvx.serve.shared_prefixes import AutoContexts
from sglang_kvx.serve.sparse_index import SparseIndex
from sglang_kvx.settings import NO_FIELDS, CompactionSettings, ServerDefaults, resolve_settings
from sglang_kvx.signals import CaptureSpec, capture_for
from sglang_kvx.signals.recorder import SignalRecorder
from sglang_kvx.store import ContextStore

logger = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 32
# What before_round asks of the prefix match: a child (the store's slots), the whole context, or to
# stay queued this round (a child waiting for its context's second passes, its room or its file, or one
# whose context's restore the round's budget decides, ``admit_restore``).
CHILD, WHOLE, WAIT = "child", "whole", "wait"


class Runtime:
    def __init__(self, config: KvxConfig, pool: KVPool, defaults: ServerDefaults, *, num_rows: int,
                 num_q_heads: int, attention_layer_ids: list[int], gdn_layer_ids: list[int],
                 rope_inv_freq: Callable[[], torch.Tensor], submit: Callable[..., None],
                 tokenizer: Any, context_len: int, gates: torch.Tensor | None = None,
                 tp: TensorParallel | None = None, num_kv_heads_total: int | None = None) -> None:
        self.config = config
        self.pool = pool
        self.defaults = defaults
        self.store = ContextStore()
        self._policies: dict[str, KVPolicy] = {}
        self.admission = Admission(pool, self.store, defaults, num_rows,
                                   parent_check=functools.partial(parent_problem, self),
                                   held_slots=self.held_slots,
                                   being_made=self._being_made, repeats=lambda request, state: self.auto.waits(request, state))
        self.recorder = SignalRecorder(pool, num_q_heads, rope_inv_freq, gdn_layer_ids, attention_layer_ids)
        self.compactor = Compactor(pool, self.policy, num_q_heads, attention_layer_ids, gdn_layer_ids,
                                   defaults.per_layer_lengths, defaults.page_size)
        # Each decode step's server-wide resources (On-Demand Attention's recall head), or why it cannot run here.
        resources, unavailable = step_resources(config, pool.device) if config.decode_steps else ({}, {})
        self.decode = DecodeRunner(pool, RowFacts(pool, gates=gates, model_path=config.model_path, resources=resources),
                                   unavailable)
        self.sparse_index = SparseIndex()  # the indexer's compressed keys per row (--kvx-sparse-attention)
        self.submit = submit
        self.tp = tp  # --tp-size > 1: per-head signals are gathered from every rank before scoring
        self.num_kv_heads_total = num_kv_heads_total or pool.num_kv_heads
        # beginnings plain requests repeat, compacted under the server's settings in the request's namespace
        self.auto = AutoContexts(config.auto_context_min_tokens, submit,
                                 functools.partial(resolve_settings, NO_FIELDS, defaults), get_policy(defaults.policy).compacts)
        self.second_pass = SecondPassRunner(pool, self.compactor, self.store, self.recorder, submit, tokenizer,
                                     context_len, self._failed)
        self.parents = ParentCompaction(pool, self.store, self.compactor, self.recorder, self.second_pass,
                                        self.capture_spec, self._failed, tp, self.num_kv_heads_total)
        # Whether the GDN backend hands over the signals it computes (ours, on CPU); else the adapter
        # has the recorder recompute them from each GDN layer's inputs.
        self.gdn_from_backend = False
        self.errors: list[str] = []  # why compactions failed (the context then stays uncompacted)
        self.failures = 0

    def policy(self, name: str) -> KVPolicy:
        if name not in self._policies:
            self._policies[name] = make_policy(name, self.config)
        return self._policies[name]

    def _failed(self, reason: str) -> None:
        self.failures += 1
        self.errors = (self.errors + [reason])[-MAX_ERRORS_KEPT:]

    # --- requests entering ---------------------------------------------------------

    def before_round(self, request: Request) -> str | None:
        """Before SGLang matches a request's prefix: CHILD (its prefix comes from the store), WHOLE (a
        parent whose policy records signals inside the prefill, or a request whose decode step reads
        the prefill's attention: it must prefill its whole context, whatever the prefix cache holds,
        or its signals would cover only the uncached part), WAIT (it stays queued: ``waits`` and
        ``admit_restore`` say more where SGLang charges it to the round's budget), or None.
        An exception here is contained to the request: it gets an error, the scheduler goes on."""
        try:
            return self._plan_round(request)
        except Exception as exc:  # noqa: BLE001 - contained to this request
            self._refuse_on_error(request, exc, "admitting")
            return None

    def admit_restore(self, request: Request, budget: RoundBudget) -> bool:
        """Where SGLang charges a queued request to the round's budget: a child whose context is held below
        the pool gets it back if the budget has room (``Admission.admit_restore``). Whether the caller must
        match its prefix again (it is now a child of the restored context, or plain); False: it waits."""
        state = request.state
        if state is None or state.plan is None or state.plan.kind != RESTORE:
            return False
        try:
            self.admission.admit_restore(request, budget)
        except Exception as exc:  # noqa: BLE001 - contained to this request
            state.plan = None
            self._refuse_on_error(request, exc, "restoring a context for")
            return False
        return not state.waits

    def make_way(self, request: Request) -> bool:
        """SGLang's round budget turned ``request`` away: whether an idle context was evicted for it
        (``Admission.make_way``; the caller asks SGLang again)."""
        return self.admission.make_way(request)

    def left_in_queue(self, request: Request) -> None:
        """SGLang did not take a queued request this round, or dropped it (aborted before it ran): a
        context it adopted is idle again until it is taken (``Admission.unadopt``)."""
        self.admission.unadopt(request)

    def _refuse_on_error(self, request: Request, exc: Exception, doing: str) -> None:
        self._failed(f"{type(exc).__name__} while {doing} a request: {exc}")
        logger.exception("sglang_kvx: %s request %s failed; it gets an error", doing, request.rid)
        # The server's fault, not the request's: a 500, which clients and SGLang's router may retry.
        request.abort(f"sglang_kvx: internal error while {doing} this request (see /kvx/stats)", 500)

    def _being_made(self, prompt_ids: list[int], settings: CompactionSettings | None) -> str | None:
        """Why a context ``prompt_ids`` extends is not stored yet though it is being made (``Admission``)."""
        if self.second_pass.pending_for(prompt_ids, settings):
            return WAIT_PASSES
        return WAIT_REPEAT if self.auto.pending_for(prompt_ids, settings) else None

    def _plan_round(self, request: Request) -> str | None:
        if self.auto.is_own(request.rid) and request.state is None:
            request.hide_from_client()  # a parent the server queued itself: no client waits for it
        plan = self.admission.before_round(request, internal_context=self.second_pass.context_of_pass(request.rid))
        state = request.state
        if (state is not None and state.decode is not None and not request.holds_kv and not request.finished
                and (problem := self.decode.unavailable.get(state.decode.step))):
            request.abort(f"sglang_kvx: decode step {state.decode.step!r} cannot be served by this server: {problem}")
            return None
        if plan.kind == PLAN_CHILD:
            return CHILD
        if plan.queued:
            return WAIT
        if plan.kind == REFUSE:
            return None
        if (state is not None and state.parent and state.settings is not None and not request.holds_kv
                and not request.finished and not self.capture_spec(state.settings).empty):
            return WHOLE
        if (state is not None and state.decode is not None and not request.holds_kv and not request.finished
                and (state.decode.step_class.reads_attention or state.decode.step_class.reads_attention_inputs)):
            return WHOLE  # online H2O scores each entry by what every query paid it, KVzap from each one's hidden state
        return None

    def bounded_max_new_tokens(self, request: Request, requested: int, max_request_len: int, pool_tokens: int) -> int | None:
        """For a request whose decode step bounds its live KV (StreamingLLM), the generation length
        it may have in place of SGLang's pool-sized clip; None: SGLang's clip stands."""
        state = self.admission.state_of(request)
        if state is None or state.decode is None or state.parent:
            return None
        live = state.decode_step().live_tokens(len(request.input_ids))
        if live is None or live + 2 > pool_tokens:
            return None
        return max(0, min(requested, max_request_len - len(request.input_ids) - 1))

    def growth_bound(self, request: Request, max_new_tokens: int) -> int | None:
        """For a request sent with ``max_new_tokens: null``: what it may generate in the room the
        store's reserve leaves it (SGLang clipped it to the whole pool, which the reserve's contexts
        partly hold); None when SGLang's clip stands. A request naming a number keeps it (refused
        with the reason when it cannot fit)."""
        state = self.admission.state_of(request)
        if state is None or not len(self.store):
            return None
        # SGLang's own empty-pool clip (its allocator's max_new_tokens_for_memory: capacity - paged prompt -
        # one page - 1), with the reserve's slots out of the capacity.
        page = self.defaults.page_size
        prompt = -(-len(request.input_ids) // page) * page
        room = self.pool.total - self.admission.eviction.kept_from(state.fields.tenant) - prompt - page - 1
        return room if 0 < room < max_new_tokens else None

    def make_decode_room(self, tokens: int) -> bool:
        """The running requests' next decode step lacks ``tokens`` slots: idle unreserved contexts go
        first (whether any did), before SGLang retracts a request."""
        return self.admission.eviction.free_idle(tokens)

    def make_extend_room(self, tokens: int) -> bool:
        """A prefill batch is about to take ``tokens`` slots that the pool may lack (what SGLang did not
        budget): idle contexts go, the reserved ones last -- the alternative is the scheduler's death."""
        return self.admission.eviction.free_idle(tokens, reserved_too=True)

    def after_alloc(self, requests: Sequence[Request]) -> None:
        """Rows are assigned: offsets and recurrent states of children; recordings of parents."""
        for request in requests:
            try:
                self._place(request)
            except Exception as exc:  # noqa: BLE001 - contained to this request
                self._refuse_on_error(request, exc, "placing")

    def _place(self, request: Request) -> None:
        self.sparse_index.forget(request.row)  # a request (or its next prefill chunk) enters the row
        context = self.admission.rows.place(request)
        state = request.state
        if state is not None and not request.finished and not request.aborted:
            if state.decode is not None and not state.parent and not state.internal:
                self.decode.admit(request.row, state.decode_step(), request)
            if context is not None and state.internal:
                self.recorder.start(request.row, len(request.input_ids), self.second_pass.capture_of(request.rid))
            elif context is None and state.parent and state.settings is not None:
                # Scored chunk by chunk inside the prefill where the policy can be (one rank: under tensor
                # parallelism a rank holds only its own GDN heads until the signals are gathered).
                policy = self.policy(state.settings.policy)
                self.recorder.start(request.row, len(request.input_ids), self.capture_spec(state.settings),
                                    policy.chunk_scoring() if self.tp is None else None)

    def capture_spec(self, settings: CompactionSettings) -> CaptureSpec:
        return self.policy(settings.policy).captures() | capture_for(allocation_needs(settings.allocation))

    # --- requests leaving ---------------------------------------------------------------

    def before_release(self, request: Request) -> None:
        self.sparse_index.forget(request.row)
        state = request.state
        if state is None:
            return
        self.auto.released(request)
        if state.decode is not None and request.holds_kv and request.row in self.decode.rows:
            outcome = self.decode.outcome(request.row)
            if outcome is not None:
                state.outcome = {**(state.outcome or {}), **outcome}
            # Slots a decode step freed already: SGLang must not free them again.
            owned_len = self.decode.release(request.row, request.owned_len)
            if owned_len is not None:
                request.keep_out_of_tree()
                request.owned_from = owned_len
        if state.context is not None:
            if state.internal and request.rid in self.second_pass.jobs:
                self.parents.contained(lambda: self.second_pass.finish_pass(request), request)
            self.admission.rows.release(request)
            if not request.finished:  # retracted: it holds no row now, and is matched afresh when retaken
                self.admission.unadopt(request, read_it=True)
            return
        if not (request.finished and state.parent and request.holds_kv):
            return
        if request.aborted or state.settings is None:
            self.recorder.take(request.row)
            return
        self.parents.contained(lambda: self.parents.compact(request, state), request)

    def outcome_once(self, request: Request) -> list[dict]:
        """The request's outcome for its response's meta_info["kvx"], once, when it finishes."""
        state = request.state
        if state is None or state.outcome is None or state.reported or not request.finished:
            return []
        state.reported = True
        return [state.outcome]

    # --- store lifetime ----------------------------------------------------------------

    def held_slots(self) -> int:
        """Pool slots held outside SGLang's tree and requests: the store's and the second passes' held contexts."""
        return self.store.slots_held() + self.second_pass.held_slots()

    def forget_all(self) -> None:
        """After SGLang flushed its pools (every slot is free again), drop every reference to them."""
        self.admission.forget_all()
        self.second_pass.forget_all()
        self.decode.forget_all()
        self.recorder.clear()

    def counts(self) -> dict[str, Any]:
        """The runtime's figures (numbers only: cheap enough for every scrape; ``serve/report.py``)."""
        return runtime_counts(self)

    def stats(self) -> dict[str, Any]:
        """``/kvx/stats``: the figures, the stored contexts and the running decode steps' reports."""
        return runtime_stats(self)


def parent_problem(runtime: Runtime, settings: CompactionSettings, n: int) -> str | None:
    """Why a parent cannot be compacted under ``settings`` beyond what admission checks (a policy whose
    resources this server lacks -- KVzap's surrogates for another checkpoint --, a second pass's length)."""
    try:
        runtime.policy(settings.policy)
    except KvxConfigError as exc:
        return f"policy {settings.policy!r} cannot be served by this server: {exc}"
    if get_policy(settings.policy).second_pass:
        return runtime.second_pass.check_fits(settings, n)
    return None
