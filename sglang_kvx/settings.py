"""A request's compaction settings: ``custom_params["kvx"]`` checked field by field, parsed once.

Two steps, both pure (no SGLang):
  ``parse_request_fields(raw)``  strict types and bounds for what a client sent, each field as the
                                 schema declares it (``schema.FIELD_SETTINGS``; run at the door,
                                 in the HTTP process, and again when the scheduler admits the request);
  ``resolve_settings(fields, ...)``  the fields over the server's flags -> one frozen
                                 ``CompactionSettings``, checked against the policy and allocation
                                 registries, the model's signals and the server's parallelism.

Every message names the request field, the expected type and the valid choices, and never echoes
a large value back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from sglang_kvx.allocate import allocation_reads_scores, allocation_needs, allocation_tp_problem
from sglang_kvx.decode import DECODE_STEPS, DecodeSettings
from sglang_kvx.policies import get_policy, servable_policy_names
from sglang_kvx.schema import FIELD_PREFIX, FIELD_SETTINGS, MAX_NAME_LENGTH, _short

# Set at the door on generating requests with n > 1: SGLang first sends their prompt as a prefill-only
# warm-up copy (same custom_params), which must not be taken for a context to compact.
GENERATING_MARK = "kvx_from_generating_request"


class SettingsError(ValueError):
    """A request's ``custom_params.kvx`` cannot be served; the message is one line for the client."""


@dataclass(frozen=True)
class CompactionSettings:
    """How one context is compacted; also the store's key beside the context's token ids."""

    policy: str
    keep_fraction: float
    protected_prefix_len: int
    allocation: str


class _FieldsMethods:
    @property
    def wants_full_cache(self) -> bool:
        return self.compact is False


# What a client sent in ``custom_params.kvx``, type-checked: one field per request field of the schema
# (``schema.FIELD_SETTINGS``); None = not sent (the server's flag applies).
RequestFields = make_dataclass(
    "RequestFields", [(s.name, Any, field(default=None)) for s in FIELD_SETTINGS], bases=(_FieldsMethods,),
    frozen=True, namespace={"__module__": __name__,
                            "__doc__": "What a client sent in ``custom_params.kvx``, type-checked; None = not sent."},
)
NO_FIELDS = RequestFields()


def parse_request_fields(raw: Any) -> RequestFields:
    """Strictly type-check a request's ``custom_params["kvx"]`` (None or absent: nothing sent)."""
    if raw is None:
        return NO_FIELDS
    if not isinstance(raw, dict):
        raise SettingsError(f"{FIELD_PREFIX} must be a JSON object; got {_short(raw)}")
    known = {s.name for s in FIELD_SETTINGS}
    unknown = [key for key in raw if key not in known]
    if unknown:
        name = unknown[0] if isinstance(unknown[0], str) and len(unknown[0]) <= MAX_NAME_LENGTH else "a long key"
        raise SettingsError(f"{FIELD_PREFIX} has an unknown field {name!r}; valid fields: {', '.join(sorted(known))}")
    try:
        return RequestFields(**{s.name: s.from_field(raw.get(s.name)) for s in FIELD_SETTINGS})
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def request_fields_of(custom_params: Any) -> RequestFields:
    """The parsed ``kvx`` entry of a request's ``custom_params`` (which SGLang leaves untyped)."""
    if custom_params is None:
        return NO_FIELDS
    if not isinstance(custom_params, dict):
        return NO_FIELDS  # custom_params is SGLang's; only its "kvx" entry is ours to police
    return parse_request_fields(custom_params.get("kvx"))


@dataclass(frozen=True)
class ServerDefaults:
    """The server's flags and what the server can do, as settings resolution needs them."""

    policy: str
    keep_fraction: float
    protected_prefix_len: int
    model_signals: frozenset[str]
    tp_size: int = 1
    per_layer_lengths: bool = True  # False on MLA backends: flat budgets only
    min_store_fraction: float = 0.25  # share of the pool no request can evict compacted contexts from
    reserved_tenants: int = 8  # tenants with a share of that reserve of their own (the rest share one)
    growth_estimate_cap: int = 4096  # SGLang's cap on a request's estimated growth when admitting it
    decode: DecodeSettings | None = None  # --kvx-decode: the step a generating request runs unless it names one
    gate_tau: float | None = None  # a gated checkpoint's frozen eviction threshold (its manifest's)
    page_size: int = 1  # SGLang's --page-size
    sparse_budget: int = 0  # --kvx-sparse-attention (0: dense attention)
    decode_steps: bool = False  # --kvx-decode-steps on (or --kvx-decode): requests may ask for a decode step


def resolve_decode(fields: RequestFields, server: ServerDefaults) -> DecodeSettings | None:
    """The decode step a request runs: its own (over the server's options when it names the same
    step), else the server's ``--kvx-decode``; checked against what the model offers."""
    own, default = fields.decode, server.decode
    if own is None or default is None or own.step != default.step:
        settings = own or default
    else:
        settings = DecodeSettings(own.step, tuple(sorted({**dict(default.options), **dict(own.options)}.items())))
    if settings is None:
        return None
    if server.sparse_budget:  # the launcher refuses --kvx-decode beside it for the same reason
        raise SettingsError(f"{FIELD_PREFIX}.decode: decode-time steps cannot run under --kvx-sparse-attention "
                            f"yet (block-sparse attention reads the whole row, slots a step evicted included)")
    if server.page_size > 1:  # the launcher refuses --kvx-decode with pages for the same reason
        raise SettingsError(f"{FIELD_PREFIX}.decode: decode-time steps are not supported with --page-size "
                            f"{server.page_size} yet (they free and hold slots one at a time); serve with --page-size 1")
    if own is not None and not server.decode_steps and default is None:
        raise SettingsError(f"{FIELD_PREFIX}.decode: this server runs without decode-time steps; launch it with "
                            f"--kvx-decode-steps on (or --kvx-decode STEP)")
    step = DECODE_STEPS[settings.step]
    missing = sorted(step.needs - server.model_signals)
    if missing:
        raise SettingsError(f"{FIELD_PREFIX}.decode.step {settings.step!r} needs {', '.join(missing)}, "
                            f"which this model does not provide" + (f" (serve {step.model_hint})" if step.model_hint else ""))
    if "tau" in step.real_options and "tau" not in dict(settings.options):
        if server.gate_tau is None:
            raise SettingsError(f"{FIELD_PREFIX}.decode.tau is needed: this checkpoint has no frozen threshold")
        settings = DecodeSettings(settings.step, tuple(sorted({**dict(settings.options), "tau": server.gate_tau}.items())))
    return settings


def resolve_settings(fields: RequestFields, server: ServerDefaults) -> CompactionSettings:
    """The request's fields over the server's flags, checked against the registries and the model."""
    policy_name = fields.policy or server.policy
    policy_cls = get_policy(policy_name)
    if not policy_cls.compacts:
        raise SettingsError(
            f"{FIELD_PREFIX}.policy is needed: the server runs without a policy; valid choices: "
            f"{', '.join(servable_policy_names())}"
        )
    if server.tp_size > 1 and policy_cls.tp_unsafe:
        raise SettingsError(
            f"policy {policy_name!r} is not supported with --tp-size {server.tp_size} yet: {policy_cls.tp_unsafe}"
        )
    if server.page_size > 1 and policy_cls.second_pass:
        raise SettingsError(f"policy {policy_name!r} is not supported with --page-size {server.page_size} yet: "
                            f"its reconstruction passes hold the context in slots that are not whole pages")
    allocation = fields.allocation or policy_cls.allocation
    problem = allocation_tp_problem(allocation) if server.tp_size > 1 else None
    if problem:
        raise SettingsError(f"allocation {allocation!r} is not supported with --tp-size {server.tp_size} yet: {problem}")
    missing = sorted((policy_cls.needs | allocation_needs(allocation)) - server.model_signals)
    if missing:
        which = f"allocation {allocation!r}" if not policy_cls.needs - server.model_signals else f"policy {policy_name!r}"
        raise SettingsError(f"{which} needs {', '.join(missing)}, which this model does not provide")
    if allocation_reads_scores(allocation):
        for refused, why in ((server.sparse_budget, "--kvx-sparse-attention regroups a layer's kept entries in blocks"),
                             (server.page_size > 1, f"--page-size {server.page_size} pages cannot hold per-head counts")):
            if refused:
                raise SettingsError(f"allocation {allocation!r} budgets each KV head, which this server cannot serve "
                                    f"yet: {why}; use allocation 'flat'")
    if allocation != "flat" and not server.per_layer_lengths:
        raise SettingsError(
            f"allocation {allocation!r} needs per-layer lengths, which this attention backend (MLA) cannot take; "
            f"use allocation 'flat'"
        )
    return CompactionSettings(
        policy=policy_name,
        keep_fraction=fields.keep_fraction if fields.keep_fraction is not None else server.keep_fraction,
        protected_prefix_len=(
            fields.protected_prefix_len if fields.protected_prefix_len is not None else server.protected_prefix_len
        ),
        allocation=allocation,
    )
