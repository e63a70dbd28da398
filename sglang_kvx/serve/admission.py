"""Admission: which requests are parents, children or plain, and what a child reads.

A *parent* (a prefill-only request, or one asking ``{"kvx": {"compact": true}}``) is compacted at
release. A *child* (its prompt strictly extends a stored context compacted under its settings)
takes the context's S rank slots as a cached prefix: its context tokens are replaced by S
placeholders, its own tokens keep their true positions (offset n - S, ``serve/child_rows.py``) and
its recurrent state starts from the parent's snapshot.

Each request entering a prefill round gets one ``Plan`` (``serve/plans.py``) from a short pipeline:

  _parse        its fields, once (a bad one: refused)
  _as_parent    a parent: room for its prompt, its settings checked
  _find         the longest stored context it extends: in the pool, or held in a tier below it
                (or it waits for its context's second passes)
  _child_checks what a child cannot be (log-probabilities inside the context; a decode step that
                does not apply to such a child): plain with the reason, or refused
  _room         room for a pooled context's child (idle contexts evicted, least recently used first)
  admit_restore (a held context; ``serve/restore_step.py``, run where SGLang charges the request to
                the round's budget) the context comes back into the pool only where the budget has
                room for it and for the child; else the child waits, or is served by a full prefill
  make_way      (any request SGLang's own budget check turned away) one more idle context goes and
                SGLang checks again, as its prefix cache's entries would make way on plain SGLang

Nothing here allocates a slot outside ``admit_restore``, and ``admit_restore`` allocates only what
the round's budget shows free after every request it already admitted: SGLang's own allocation for
the batch cannot fail for want of what the extension took.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from sglang_kvx.policies import get_policy
from sglang_kvx.ports import KVPool, Request, RoundBudget
from sglang_kvx.serve.child_rows import ChildRows
from sglang_kvx.serve.eviction import StoreEviction
from sglang_kvx.serve.plans import (CHILD, PARENT_PLAN, PLAIN, PLAIN_PLAN, REFUSE, REFUSED, RESTORE, WAIT_READ,
                                    WAIT_REPEAT, Plan, refuse, wait)
from sglang_kvx.serve.restore_step import RestoreStep
from sglang_kvx.serve.request_state import RequestState, settings_of, state_of
from sglang_kvx.settings import CompactionSettings, ServerDefaults
from sglang_kvx.store import CompactedContext, ContextStore

logger = logging.getLogger(__name__)

class Admission:
    def __init__(self, pool: KVPool, store: ContextStore, defaults: ServerDefaults, num_rows: int,
                 parent_check: Callable[[CompactionSettings, int], str | None] = lambda settings, n: None,
                 held_slots: Callable[[], int] | None = None,
                 being_made: Callable[[list[int], CompactionSettings | None], str | None] = lambda ids, settings: None,
                 repeats: Callable[[Request, RequestState], bool] = lambda request, state: False) -> None:
        self.pool = pool
        # (prompt, settings) -> why a context the prompt extends is not stored yet though it is being made
        # (WAIT_PASSES: scored by KVzip's second passes; WAIT_REPEAT: a beginning plain requests repeat, queued
        # by the server), or None; settings None: any context
        self.being_made = being_made
        # (a plain request with no context, its state) -> it now waits for the beginning it
        # repeats, queued as the server's own parent (--kvx-auto-context-min-tokens)
        self.repeats = repeats
        self.children_waited: Counter[str] = Counter()  # children that waited for their context to be made, by reason
        self.eviction = StoreEviction(pool, store, defaults, held_slots or store.slots_held)
        self.tiering = self.eviction.tiering
        self.parent_check = parent_check  # further reasons to refuse a parent (KVzip's pass length)
        self.store = store
        self.defaults = defaults
        self.rows = ChildRows(pool, num_rows)
        self.restore = RestoreStep(pool, store, self.eviction)

    # --- a request's fields, parsed once ---------------------------------------------------------

    def state_of(self, request: Request) -> RequestState | None:
        """The request's state, parsed on first sight; None (and the request aborted) when its fields are bad."""
        return state_of(request, self.defaults)

    def settings_of(self, request: Request, state: RequestState) -> CompactionSettings | None:
        return settings_of(request, state, self.defaults)

    # --- the pipeline ----------------------------------------------------------------------------

    def before_round(self, request: Request, internal_context: CompactedContext | None = None) -> Plan:
        """Before SGLang matches a request's prefix: its plan for this round (``serve/plans.py``)."""
        state = request.state
        if state is not None and state.context is not None:
            return Plan(CHILD, state.context) if not request.holds_kv else PLAIN_PLAN
        if request.has_output or request.finished:
            return PLAIN_PLAN
        state = self.state_of(request)
        if state is None:
            return REFUSED
        if internal_context is not None:  # a KVzip reconstruction pass: a child of the held full context
            return self._internal_pass(request, state, internal_context)
        plan = self._as_parent(request, state) if state.parent else self._as_child(request, state)
        state.plan = plan if plan.queued else None
        if plan.kind == REFUSE and plan.reason is not None:
            request.abort(f"sglang_kvx: {plan.reason}", plan.status)
        return plan

    def _internal_pass(self, request: Request, state: RequestState, context: CompactedContext) -> Plan:
        self.eviction.make_room(len(request.input_ids) - context.n, keep=context, tenant=context.tenant)
        request.keep_out_of_tree()
        request.hide_from_client()
        state.internal = True
        self._adopt(state, context)
        return Plan(CHILD, context)

    def _as_parent(self, request: Request, state: RequestState) -> Plan:
        never = self.eviction.make_room(self._wanted(request), tenant=state.fields.tenant)
        if never is not None:
            return refuse(never)
        if not state.checked:
            state.checked = True
            settings = self.settings_of(request, state)
            if settings is None:
                return REFUSED
            n = len(request.input_ids)
            if settings.protected_prefix_len >= n:
                return refuse(f"protected prefix of {settings.protected_prefix_len} tokens leaves nothing to compact "
                              f"in the {n}-token context")
            if problem := self.parent_check(settings, n):
                return refuse(problem)
        return PARENT_PLAN

    def _as_child(self, request: Request, state: RequestState) -> Plan:
        # Without a policy of its own or the server's, a request reads no compacted context (another
        # client's parent named one): it is plain, whatever the store holds.
        names_a_policy = state.fields.policy is not None or get_policy(self.defaults.policy).compacts
        if state.fields.policy is not None and self.settings_of(request, state) is None:
            return REFUSED  # the settings a request names are checked whether or not the store holds a context
        found = self._find(request, state) if names_a_policy and not state.fields.wants_full_cache else None
        if found is not None and found.kind in (CHILD, RESTORE):
            found = self._child_checks(request, state, found) or found
        if found is None and self.repeats(request, state):
            return self._waited(state, WAIT_REPEAT)  # read as a child of it: its beginning is not prefilled twice
        if found is None or found.kind == PLAIN:
            never = self.eviction.make_room(self._wanted(request), tenant=state.fields.tenant)
            return refuse(never) if never is not None else PLAIN_PLAN
        if found.kind == CHILD:
            return self._room(request, state, found.context)
        return found  # RESTORE (the budget's step), WAIT or REFUSE

    def _find(self, request: Request, state: RequestState) -> Plan | None:
        """The longest stored context the prompt extends: CHILD (in the pool), RESTORE (longer, held in a
        tier below it), WAIT (its context is being scored), or None."""
        previous = state.plan
        if (previous is not None and previous.reason == WAIT_READ and not state.skip_tiers
                and self.store.get(previous.held.entry.context_ids, previous.held.settings) is None):
            return Plan(RESTORE, held=previous.held)  # its file's read (done, or not yet) decides
        stored = len(self.store) or (not state.skip_tiers and self.tiering.holds_any())
        if not (stored or self.being_made(request.input_ids, None)):
            return None
        settings = self.settings_of(request, state)
        if settings is None:
            return REFUSED
        context = self.store.longest_prefix_of(request.input_ids, settings)
        if not state.skip_tiers:
            held = self.tiering.locate(request.input_ids, settings, beaten=context.n if context is not None else 0)
            if held is not None:
                return Plan(RESTORE, held=held)
        if context is not None:
            return Plan(CHILD, context)
        if reason := self.being_made(request.input_ids, settings):
            # Its context is being made: served when it is stored, as the same child sent a moment
            # later would be (not from the full cache, which would depend on timing).
            return self._waited(state, reason)
        return None

    def _waited(self, state: RequestState, reason: str) -> Plan:
        if state.waited_since is None:
            state.waited_since = time.monotonic()
            self.children_waited[reason] += 1
        return wait(reason)

    def _child_checks(self, request: Request, state: RequestState, found: Plan) -> Plan | None:
        """What a child of ``found``'s context cannot be: None (it can), PLAIN (served with the full
        cache, the reason in its outcome) or REFUSE."""
        context = found.context if found.kind == CHILD else found.held
        logprobs_from = request.input_logprobs_from
        if logprobs_from is not None and logprobs_from < context.n:
            # Log-probabilities of the context's own tokens need its whole cache (a full prefill), as on plain SGLang.
            state.outcome = {"child": False, "context_tokens": context.n, "reason": f"logprob_start_len {logprobs_from} "
                             f"lies inside the stored context ({context.n} tokens): served with the full cache"}
            return PLAIN_PLAN
        problem = state.decode and state.decode.step_class.child_problem(context.per_head, context.settings.allocation)
        if problem:
            if state.fields.decode is not None:
                return refuse(f"{problem}; or send it with \"compact\": false")
            state.decode = None  # the server's default is not applied to such children: full attention
        return None

    def _wanted(self, request: Request, prompt_tokens: int | None = None) -> int:
        return self.eviction.slots_wanted(len(request.input_ids) if prompt_tokens is None else prompt_tokens,
                                          request.max_new_tokens)

    def _room(self, request: Request, state: RequestState, context: CompactedContext) -> Plan:
        """Room for a pooled context's child: its own tokens, never by evicting the context it reads."""
        never = self.eviction.make_room(self._wanted(request) - context.n, keep=context, tenant=state.fields.tenant)
        if never is not None:
            return refuse(never)
        self._become_child(request, state, context)
        return Plan(CHILD, context)

    def _become_child(self, request: Request, state: RequestState, context: CompactedContext) -> None:
        """Placeholders for the stored rank slots (never embedded: the whole run is a cached prefix)."""
        logprobs_from = request.input_logprobs_from
        state.prompt = (tuple(request.input_ids), logprobs_from)
        question = list(request.input_ids[context.n :])
        request.replace_input_ids(list(context.context_ids[: context.num_slots]) + question)
        if logprobs_from is not None:  # the prompt is now S placeholders + the question: same token, new index
            request.input_logprobs_from = logprobs_from - (context.n - context.num_slots)
        request.keep_out_of_tree()  # its prefix is the store's, not the tree's
        context.reuse_count += 1
        self._adopt(state, context)
        state.outcome = {"child": True, "context_tokens": context.n, "slots": context.num_slots,
                         "policy": context.settings.policy, "keep_fraction": context.settings.keep_fraction,
                         **(state.restored or {})}
        source = (state.restored or {}).get("restored_from") or "pool"
        state.usage = {"hidden": context.n - context.num_slots, "context_tokens": context.n, "source": f"kvx_{source}"}
        if state.waited_since is not None:
            state.outcome["waited_for_second_passes_s"] = round(time.monotonic() - state.waited_since, 3)

    @staticmethod
    def _adopt(state: RequestState, context: CompactedContext) -> None:
        state.context = context
        context.active_children += 1
        context.last_used = time.monotonic()

    # --- a held context back into the pool, within the round's budget ------------------------------

    def admit_restore(self, request: Request, budget: RoundBudget) -> None:
        """Where SGLang charges a request whose plan is RESTORE to the round's budget (``serve/restore_step.py``)."""
        self.restore.admit(request, budget)

    def make_way(self, request: Request) -> bool:
        """SGLang's round budget could not hold ``request``: an idle context goes (never the one it
        reads, nor another tenant's reserved ones). Whether one went."""
        state = request.state
        if state is None or state.waits:
            return False
        return self.eviction.make_way(state.context, state.fields.tenant)

    # --- leaving -----------------------------------------------------------------------------------

    def unadopt(self, request: Request, read_it: bool = False) -> None:
        """A child that holds no row pins nothing: SGLang left it queued this round, retracted it, or
        dropped it. Its context is idle again (evictable for a running request's decode, which would
        otherwise find no room it could take, where plain SGLang always has it) and its prompt its own;
        it is matched afresh when SGLang takes it (a retracted one, which has output, then prefills)."""
        state = request.state
        if state is None or state.context is None or state.internal or request.holds_kv:
            return
        state.context.active_children -= 1
        if not read_it:
            state.context.reuse_count -= 1  # counted again when it is taken
        state.context = None
        if state.prompt is not None:
            request.replace_input_ids(list(state.prompt[0]))
            if state.prompt[1] is not None:
                request.input_logprobs_from = state.prompt[1]
            state.prompt = None
        state.usage = None
        state.outcome = None

    def forget_all(self) -> None:
        self.store.contexts.clear()
        self.tiering.clear()  # /flush_cache empties every tier too
        self.rows.clear()
