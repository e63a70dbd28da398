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

import functools

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from sglang_kvx.checks import ServingFacts, decode_problem, policy_problem, with_checkpoint_tau
from sglang_kvx.decode import DecodeSettings
from sglang_kvx.policies import get_policy, servable_policy_names
from sglang_kvx.schema import FIELD_PREFIX, FIELD_SETTINGS, FLAG_SETTINGS, MAX_NAME_LENGTH, _short

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
    # SGLang's prefix-cache namespace of the request (its extra_key and cache_salt; None: neither), which
    # isolates compacted contexts exactly as it isolates radix entries: every tier's key holds it.
    namespace: tuple[str | None, str | None] | None = None


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


class _DefaultsMethods:
    @functools.cached_property
    def facts(self) -> ServingFacts:
        """Built once per server (the defaults are frozen); every request's checks read this one."""
        return ServingFacts(tp_size=self.tp_size, page_size=self.page_size, sparse_budget=self.sparse_budget,
                            model_signals=self.model_signals, per_layer_lengths=self.per_layer_lengths)

    @classmethod
    def of(cls, config: Any, **facts: Any) -> "ServerDefaults":
        """A scheduler's defaults: every flag's typed value from the launch's ``config.KvxConfig``, and ``facts``."""
        return cls(**{s.config_attr: getattr(config, s.config_attr) for s in FLAG_SETTINGS},
                   gate_tau=config.gate_tau, **facts)


# What the scheduler knows beyond the flags (the model, SGLang's own settings), with their defaults.
SERVER_FACTS = (
    ("tp_size", int, 1),
    ("per_layer_lengths", bool, True),  # False on MLA backends: flat budgets only
    ("growth_estimate_cap", int, 4096),  # SGLang's cap on a request's estimated growth when admitting it
    ("page_size", int, 1),  # SGLang's --page-size
    ("gate_tau", "float | None", None),  # a gated checkpoint's frozen eviction threshold (its manifest's)
    ("model_fingerprint", str, ""),  # what a context file must match to load (store/context_file.model_fingerprint)
)
_LEADING = tuple(s for s in FLAG_SETTINGS[:3])  # policy, keep_fraction, protected_prefix_len: given first, always
# The server's settings as the scheduler reads them: the flags' typed values (one field per flag of the
# schema, as ``config.KvxConfig``), the model's signals and the facts above. Nothing is restated: a new
# flag of ``schema.SETTINGS`` is here with its parsed default.
ServerDefaults = make_dataclass(
    "ServerDefaults",
    [(s.config_attr, Any) for s in _LEADING] + [("model_signals", frozenset)]
    + [(name, kind, field(default=default)) for name, kind, default in SERVER_FACTS]
    + [(s.config_attr, Any, field(default=s.from_flag(s.default))) for s in FLAG_SETTINGS if s not in _LEADING],
    bases=(_DefaultsMethods,), frozen=True, namespace={"__module__": __name__, "__doc__":
        "The server's flags (typed, from the schema), the model's signals and what the server can do, as "
        "settings resolution and admission need them."},
)


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
    if problem := decode_problem(settings.step, server.facts, label=f"{FIELD_PREFIX}.decode",
                                 step_label=f"{FIELD_PREFIX}.decode.step {settings.step!r}"):
        raise SettingsError(problem)
    if own is not None and not server.decode_steps and default is None:
        raise SettingsError(f"{FIELD_PREFIX}.decode: this server runs without decode-time steps; launch it with "
                            f"--kvx-decode-steps (or --kvx-decode STEP)")
    options = with_checkpoint_tau(settings.step, dict(settings.options), server.gate_tau)
    if options is None:
        raise SettingsError(f"{FIELD_PREFIX}.decode.tau is needed: this checkpoint has no frozen threshold")
    if options == dict(settings.options):
        return settings
    return DecodeSettings(settings.step, tuple(sorted(options.items())))


def resolve_settings(fields: RequestFields, server: ServerDefaults,
                     namespace: tuple[str | None, str | None] | None = None) -> CompactionSettings:
    """The request's fields over the server's flags, checked against the registries and the model, in the
    request's prefix-cache ``namespace``."""
    policy_name = fields.policy or server.policy
    policy_cls = get_policy(policy_name)
    if not policy_cls.compacts:
        raise SettingsError(
            f"{FIELD_PREFIX}.policy is needed: the server runs without a policy; valid choices: "
            f"{', '.join(servable_policy_names())}"
        )
    allocation = fields.allocation or policy_cls.allocation
    if problem := policy_problem(policy_name, allocation, server.facts, label=f"policy {policy_name!r}",
                                 allocation_label=f"allocation {allocation!r}"):
        raise SettingsError(problem)
    return CompactionSettings(
        policy=policy_name,
        keep_fraction=fields.keep_fraction if fields.keep_fraction is not None else server.keep_fraction,
        protected_prefix_len=(
            fields.protected_prefix_len if fields.protected_prefix_len is not None else server.protected_prefix_len
        ),
        allocation=allocation,
        namespace=namespace,
    )
