"""Admission: which requests are parents, children or plain, and what a child reads.

A *parent* (a prefill-only request, or one asking ``{"kvx": {"compact": true}}``) is compacted at
release. A *child* (its prompt strictly extends a stored context compacted under its settings)
takes the context's S rank slots as a cached prefix: its context tokens are replaced by S
placeholders, its own tokens keep their true positions (offset n - S) and its recurrent state
starts from the parent's snapshot. Room for a waiting request is made by evicting idle stored
contexts, least recently used first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from sglang_kvx.decode import DecodeSettings, DecodeStep
from sglang_kvx.policies import get_policy
from sglang_kvx.ports import Batch, KVPool, Request
from sglang_kvx.settings import GENERATING_MARK, CompactionSettings, RequestFields, ServerDefaults, SettingsError, request_fields_of, resolve_decode, resolve_settings
from sglang_kvx.serve.eviction import StoreEviction
from sglang_kvx.serve.tiering import ROOM_LATER
from sglang_kvx.store import CompactedContext, ContextStore, PrefixCells

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """The extension's state of one request, parsed once when it is first admitted."""

    fields: RequestFields
    parent: bool
    settings: CompactionSettings | None = None  # resolved for parents, and for children while the store is non-empty
    context: CompactedContext | None = None  # the stored context a child (or a KVzip pass) reads
    internal: bool = False  # a KVzip reconstruction pass
    checked: bool = False  # a parent's settings were validated against its context
    outcome: dict | None = None  # what the extension did with it, for the response's meta_info["kvx"]
    reported: bool = False  # the outcome went out with a response
    decode: DecodeSettings | None = None  # the decode step it runs (its own or --kvx-decode's)
    prefix_checked: bool = False  # a plain request was compared with earlier prompts (shared beginnings)
    built_step: DecodeStep | None = None  # ``decode`` built, once (``decode_step``)
    waits: bool = False  # a child whose context's second passes still run: it stays queued until they end
    waited_since: float | None = None  # when it first waited (its response says how long)

    def decode_step(self) -> DecodeStep:
        """The request's decode step, built on first use and kept: one instance per request, which
        may hold state of its own; every later use (its generation bound, its row) reads this one."""
        if self.built_step is None:
            self.built_step = self.decode.build()
        return self.built_step


class Admission:
    def __init__(self, pool: KVPool, store: ContextStore, defaults: ServerDefaults, num_rows: int,
                 parent_check: Callable[[CompactionSettings, int], str | None] = lambda settings, n: None,
                 held_slots: Callable[[], int] | None = None,
                 passes_pending: Callable[[list[int], CompactionSettings | None], bool] = lambda ids, settings: False) -> None:
        self.pool = pool
        # (prompt, settings) -> a context the prompt extends is still being scored (KVzip); settings None: any context
        self.passes_pending = passes_pending
        self.children_waited = 0  # children that waited for their context's second passes
        self.eviction = StoreEviction(pool, store, defaults, held_slots or store.slots_held)
        self.parent_check = parent_check  # further reasons to refuse a parent (KVzip's pass length)
        self.store = store
        self.defaults = defaults
        self.row_context: dict[int, CompactedContext] = {}  # request row -> the compacted prefix it reads
        # True-position offset of each request row's tokens (n - S for a child, else 0).
        self.position_offset = torch.zeros(num_rows, dtype=torch.int64, device=pool.device)

    # --- state -------------------------------------------------------------------

    def state_of(self, request: Request) -> RequestState | None:
        """The request's state, parsed on first sight; None (and the request aborted) when its fields are bad."""
        state = request.state
        if state is None:
            try:
                fields = request_fields_of(request.custom_params)
                decode = resolve_decode(fields, self.defaults)  # checked against the model even where unused
            except SettingsError as exc:
                request.abort(f"sglang_kvx: {exc}")
                return None
            parent = fields.compact if fields.compact is not None else request.max_new_tokens == 0
            # SGLang's prefix warm-up for parallel sampling (n > 1) is prefill-only but no context.
            custom = request.custom_params
            if fields.compact is None and isinstance(custom, dict) and custom.get(GENERATING_MARK) is True:
                parent = False
            # Without a policy (a decode-steps-only server) a request is a parent only by naming one.
            parent = parent and (fields.policy is not None or get_policy(self.defaults.policy).compacts)
            decode = None if parent or request.max_new_tokens == 0 else decode
            state = request.state = RequestState(fields=fields, parent=parent, decode=decode)
        return state

    def settings_of(self, request: Request, state: RequestState) -> CompactionSettings | None:
        if state.settings is None:
            try:
                state.settings = resolve_settings(state.fields, self.defaults)
            except (SettingsError, ValueError) as exc:
                request.abort(f"sglang_kvx: {exc}")
                return None
        return state.settings

    # --- entering a prefill --------------------------------------------------------

    def before_round(self, request: Request, internal_context: CompactedContext | None = None) -> bool:
        """Before SGLang matches a request's prefix: True when it is a child whose prefix the caller
        takes from the store instead of the prefix cache."""
        state = request.state
        if state is not None and state.context is not None:
            return not request.holds_kv
        if request.has_output or request.finished:
            return False
        state = self.state_of(request)
        if state is None:
            return False
        wanted = self.eviction.slots_wanted(len(request.input_ids), request.max_new_tokens)
        if internal_context is not None:  # a KVzip reconstruction pass: a child of the held full context
            self.eviction.make_room(len(request.input_ids) - internal_context.n, keep=internal_context,
                           tenant=internal_context.tenant)
            request.keep_out_of_tree()
            request.hide_from_client()
            state.internal = True
            self._adopt(state, internal_context)
            return True
        tenant = state.fields.tenant
        if state.parent:
            if self._no_room_ever(request, self.eviction.make_room(wanted, tenant=tenant)):
                return False
            self._check_parent(request, state)
            return False
        context, restored_from, restore_problem = None, None, None
        # Without a policy of its own or the server's, a request reads no compacted context (another
        # client's parent named one): it is plain, whatever the store holds.
        names_a_policy = state.fields.policy is not None or get_policy(self.defaults.policy).compacts
        if state.fields.policy is not None and self.settings_of(request, state) is None:
            return False  # the settings a request names are checked whether or not the store holds a context
        state.waits = False
        stored = len(self.store) or self.eviction.tiering.holds_any()
        if not state.fields.wants_full_cache and names_a_policy and (stored or self.passes_pending(request.input_ids, None)):
            settings = self.settings_of(request, state)
            if settings is None:
                return False
            context = self.store.longest_prefix_of(request.input_ids, settings)
            if self.eviction.tiering.holds_any():
                context, restored_from, restore_problem = self.eviction.from_tiers(request.input_ids, settings, context, tenant)
                if restore_problem == ROOM_LATER:  # its context comes back once running requests free the room
                    state.waits = True  # queued; the requests behind it go on
                    return False
            if context is None and self.passes_pending(request.input_ids, settings):
                # Its context is being scored by second passes: served when they end, as the same child
                # sent a moment later would be (not from the full cache, which would depend on timing).
                state.waits = True
                if state.waited_since is None:
                    state.waited_since = time.monotonic()
                    self.children_waited += 1
                return False
        logprobs_from = request.input_logprobs_from
        if context is not None and logprobs_from is not None and logprobs_from < context.n:
            # Log-probabilities of the context's own tokens need its whole cache (a full prefill), as on plain SGLang.
            state.outcome = {"child": False, "context_tokens": context.n, "reason": f"logprob_start_len {logprobs_from} "
                             f"lies inside the stored context ({context.n} tokens): served with the full cache"}
            context = None
        if context is None:
            if restore_problem is not None:  # its context is in a tier the pool could not take it back from
                state.outcome = {"child": False, "reason": restore_problem}
            self._no_room_ever(request, self.eviction.make_room(wanted, tenant=tenant))
            return False
        if state.decode is not None and context.layout.per_head:
            if state.fields.decode is not None:
                request.abort(f"sglang_kvx: decode step {state.decode.step!r} does not yet apply to a child of a context "
                              f"compacted with per-head budgets (allocation {context.settings.allocation!r}); send it with "
                              f"\"compact\": false, or compact the context with allocation 'flat'")
                return False
            state.decode = None  # the server's default is not applied to such children: full attention
        if state.decode is not None and state.decode.step_class.drops:
            if state.fields.decode is not None:
                request.abort(f"sglang_kvx: decode step {state.decode.step!r} evicts entries, which does not yet "
                              f"apply to a child of a compacted context; send it with \"compact\": false")
                return False
            state.decode = None  # the server's evicting default is not applied to children: full attention
        # Room for the child's own tokens, never by evicting the context it is about to read.
        if self._no_room_ever(request, self.eviction.make_room(wanted - context.n, keep=context, tenant=tenant)):
            return False
        # Placeholders for the stored rank slots (never embedded: the whole run is a cached prefix).
        question = list(request.input_ids[context.n :])
        request.replace_input_ids(list(context.context_ids[: context.num_slots]) + question)
        if logprobs_from is not None:  # the prompt is now S placeholders + the question: same token, new index
            request.input_logprobs_from = logprobs_from - (context.n - context.num_slots)
        request.keep_out_of_tree()  # its prefix is the store's, not the tree's
        context.reuse_count += 1
        self._adopt(state, context)
        state.outcome = {"child": True, "context_tokens": context.n, "slots": context.num_slots,
                         "policy": context.settings.policy, "keep_fraction": context.settings.keep_fraction}
        if state.waited_since is not None:
            state.outcome["waited_for_second_passes_s"] = round(time.monotonic() - state.waited_since, 3)
        if restored_from is not None or restore_problem is not None:
            state.outcome.update({"restored_from": restored_from, "restore_s": context.timings["restore_s"]}
                                 if restored_from is not None else {"restore_failed": restore_problem})
        return True

    @staticmethod
    def _adopt(state: RequestState, context: CompactedContext) -> None:
        state.context = context
        context.active_children += 1
        context.last_used = time.monotonic()

    @staticmethod
    def _no_room_ever(request: Request, problem: str | None) -> bool:
        """Refuse (400) a request ``make_room`` says can never be admitted: SGLang would queue it for
        good, and every request behind it would wait too."""
        if problem is not None:
            request.abort(f"sglang_kvx: {problem}")
        return problem is not None

    def _check_parent(self, request: Request, state: RequestState) -> None:
        if state.checked:
            return
        state.checked = True
        settings = self.settings_of(request, state)
        if settings is None:
            return
        n = len(request.input_ids)
        if settings.protected_prefix_len >= n:
            request.abort(
                f"sglang_kvx: protected prefix of {settings.protected_prefix_len} tokens leaves nothing to compact "
                f"in the {n}-token context"
            )
            return
        problem = self.parent_check(settings, n)
        if problem is not None:
            request.abort(f"sglang_kvx: {problem}")

    def child_prefix_slots(self, request: Request) -> torch.Tensor | None:
        state = request.state
        context = state.context if state is not None else None
        return None if context is None else context.slots[: request.prefix_len]

    def place(self, request: Request) -> CompactedContext | None:
        """Its row is assigned: record the row's position offset; a child's recurrent state starts from
        the parent's snapshot. Returns the context a child reads (None for others)."""
        row = request.row
        state = request.state
        context = state.context if state is not None else None
        if context is None:
            self.row_context.pop(row, None)
            self.position_offset[row] = 0
            return None
        self.position_offset[row] = context.n - context.num_slots
        self.row_context[row] = context
        if context.gdn_snapshot is not None and request.prefix_len == context.num_slots:
            self.pool.restore_state(request, context.gdn_snapshot)
        return context

    def release_child(self, request: Request) -> None:
        context = request.state.context
        if request.finished:
            context.active_children -= 1
        if request.holds_kv:
            self.position_offset[request.row] = 0
            self.row_context.pop(request.row, None)

    # --- what attention reads ------------------------------------------------------

    @property
    def any_offsets(self) -> bool:
        """Whether some running row reads a compacted prefix (positions to shift); no device sync."""
        return bool(self.row_context)

    def masked_rows(self, layer: int, batch: Batch) -> dict[int, PrefixCells]:
        """Batch index -> PrefixCells for each row reading a compacted prefix that attention layer
        ``layer`` reads other than as its S slots (masked ranks, borrowed cells). Looks at the
        batch's rows only while a child of such a context runs."""
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return {}
        found = {}
        for i, row in enumerate(batch.rows):
            context = self.row_context.get(row)
            if context is not None and context.prefix_cells[layer] is not None:
                found[i] = context.prefix_cells[layer]
        return found

    def child_contexts(self, layer: int, batch: Batch) -> dict[int, tuple[CompactedContext, PrefixCells | None]]:
        """Batch index -> (the compacted context the row reads, its cells in attention layer ``layer``)."""
        if not self.row_context:
            return {}
        found = {}
        for i, row in enumerate(batch.rows):
            context = self.row_context.get(row)
            if context is not None:
                found[i] = (context, context.prefix_cells[layer] if context.prefix_cells else None)
        return found

    def needs_per_layer_lengths(self, batch: Batch) -> bool:
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return False
        return any(self.row_context[row].needs_masked_attention for row in batch.rows if row in self.row_context)

    def forget_all(self) -> None:
        self.store.contexts.clear()
        self.eviction.tiering.clear()  # /flush_cache empties every tier too
        self.row_context.clear()
        self.position_offset.zero_()
