"""A request's state in the extension, parsed once when it is first admitted.

``state_of`` reads its ``custom_params.kvx`` fields (``settings.py``), decides whether it is a parent,
and which decode step it runs; a field that cannot be served refuses the request (400) with a line
naming it -- among them fields that would do nothing on this server (a compaction setting where no
policy runs, a decode step on a parent).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvx.decode import DecodeSettings, DecodeStep
from sglang_kvx.policies import get_policy
from sglang_kvx.ports import Request
from sglang_kvx.schema import FIELD_PREFIX
from sglang_kvx.serve.plans import WAIT_ROOM, Plan
from sglang_kvx.settings import (GENERATING_MARK, CompactionSettings, RequestFields, ServerDefaults, SettingsError,
                                 request_fields_of, resolve_decode, resolve_settings)
from sglang_kvx.store import CompactedContext

# Request fields that only a compacting request reads: sent to a server without a policy (and without
# naming one), they would do nothing.
COMPACTION_FIELDS = ("keep_fraction", "protected_prefix_len", "allocation")


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
    plan: Plan | None = None  # this round's plan while it stays queued (WAIT, RESTORE)
    waited_since: float | None = None  # when it first waited for second passes (its response says how long)
    skip_tiers: bool = False  # a restore of its context failed: it is served without the tiers
    restored: dict | None = None  # where its context came back from, for its outcome
    usage: dict | None = None  # a child's prompt tokens SGLang does not see (n - S) and their source (adapter/usage.py)
    prompt: tuple | None = None  # a child's own prompt and logprob start, while placeholders stand in for its context

    def decode_step(self) -> DecodeStep:
        """The request's decode step, built on first use and kept: one instance per request, which
        may hold state of its own; every later use (its generation bound, its row) reads this one."""
        if self.built_step is None:
            self.built_step = self.decode.build()
        return self.built_step

    @property
    def waits(self) -> bool:
        return self.plan is not None and self.plan.queued



def state_of(request: Request, defaults: ServerDefaults) -> RequestState | None:
    """The request's state, parsed on first sight; None (and the request aborted) when its fields are bad."""
    state = request.state
    if state is None:
        try:
            state = request.state = _parse(request, defaults)
        except SettingsError as exc:
            request.abort(f"sglang_kvx: {exc}")
            return None
    return state


def _parse(request: Request, defaults: ServerDefaults) -> RequestState:
    fields = request_fields_of(request.custom_params)
    decode = resolve_decode(fields, defaults)  # checked against the model even where unused
    server_compacts = get_policy(defaults.policy).compacts
    if fields.policy is None and not server_compacts:
        # Without a policy of its own or the server's, nothing compacts it: a field asking for that is refused.
        if fields.compact is True:
            raise SettingsError(f"{FIELD_PREFIX}.compact true needs a policy: this server runs without one "
                                f"(--kvx-policy none); name {FIELD_PREFIX}.policy")
        sent = next((name for name in COMPACTION_FIELDS if getattr(fields, name) is not None), None)
        if sent is not None:
            raise SettingsError(f"{FIELD_PREFIX}.{sent} has no effect: this server runs without a policy "
                                f"(--kvx-policy none); name {FIELD_PREFIX}.policy, or drop the field")
    parent = fields.compact if fields.compact is not None else request.max_new_tokens == 0
    custom = request.custom_params
    # SGLang's prefix warm-up for parallel sampling (n > 1) is prefill-only but no context.
    if fields.compact is None and isinstance(custom, dict) and custom.get(GENERATING_MARK) is True:
        parent = False
    # Without a policy (a decode-steps-only server) a request is a parent only by naming one.
    parent = parent and (fields.policy is not None or server_compacts)
    outcome = None
    if decode is not None and (parent or request.max_new_tokens == 0):
        if parent and request.max_new_tokens != 0:
            if fields.decode is not None:
                raise SettingsError(f"{FIELD_PREFIX}.decode: a decode step does not run on a parent (its cache is "
                                    f"compacted when it finishes); send it with \"compact\": false to run the step")
            outcome = {"decode_not_applied": f"the server's decode step {decode.step!r} does not run on a parent"}
        decode = None
    return RequestState(fields=fields, parent=parent, decode=decode, outcome=outcome)


def settings_of(request: Request, state: RequestState, defaults: ServerDefaults) -> CompactionSettings | None:
    """The request's compaction settings, resolved once; None (and the request aborted) when they cannot be served."""
    if state.settings is None:
        try:
            state.settings = resolve_settings(state.fields, defaults, request.namespace)
        except (SettingsError, ValueError) as exc:
            request.abort(f"sglang_kvx: {exc}")
            return None
    return state.settings


# --- what the adapter asks of a queued or running request's state ---------------------------------------


def waits(request: Request) -> bool:
    """Whether a queued request stays queued this round (its plan is WAIT, or RESTORE not yet admitted)."""
    state = request.state
    return state is not None and state.waits


def waits_for_room(request: Request) -> bool:
    """Whether a waiting request waits for room (SGLang then ends the round, as for any request that does
    not fit: first come, first served); else the requests behind it go on."""
    state = request.state
    return state is not None and state.plan is not None and state.plan.reason == WAIT_ROOM


def usage_of(request: Request) -> list[dict]:
    """A child's prompt tokens SGLang does not see (its context's n - S) and where they came from, with
    every output of it (``adapter/usage.py`` corrects SGLang's counts with it); [] for others."""
    state = request.state
    return [state.usage] if state is not None and state.usage is not None and not state.internal else []
