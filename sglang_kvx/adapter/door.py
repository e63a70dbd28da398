"""Request validation at the door: in the HTTP process, before a request reaches the scheduler.

An AFTER hook on the tokenizer manager's own per-request validation (the narrowest point that sees
every generate request with its token ids, for ``/generate``, ``/v1/completions`` and chat alike):
a ValueError raised there is SGLang's 400 with our message. Refused here: a bad
``custom_params.kvx`` (strict types, see ``sglang_kvx.settings``), token ids outside the
vocabulary, an empty prompt asked to generate, client request ids in the extension's internal
namespace, and a ``custom_params.kvx`` asking for compaction or a decode step from a server where the
extension does nothing (launched without its flags), which would otherwise ignore it silently.
"""

from __future__ import annotations

from sglang_kvx.compact.second_pass import INTERNAL_RID_PREFIX
from sglang_kvx.schema import FIELD_SETTINGS
from sglang_kvx.settings import GENERATING_MARK, SettingsError, parse_request_fields

# Request fields that ask the extension for nothing on their own (a tenant tags whose contexts are whose).
PASSIVE_FIELDS = ("tenant",)


def register_door() -> None:
    """The HTTP process's hooks: this door, and the children's usage counts (``adapter/usage.py``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_kvx.adapter.contract import DOOR_HOOKS, USAGE_HOOKS
    from sglang_kvx.adapter import usage

    HookRegistry.register(DOOR_HOOKS[0], after_validate_one_request, HookType.AFTER)
    for target, (name, kind) in USAGE_HOOKS.items():
        HookRegistry.register(target, getattr(usage, name), HookType(kind))


def after_validate_one_request(_result, tokenizer_manager, obj, input_ids=None, *_args, **_kwargs) -> None:
    from sglang_kvx.adapter.server_config import config_of

    problem = door_problem(
        extension_active=config_of(tokenizer_manager.server_args).enabled,
        rid=getattr(obj, "rid", None),
        sampling_params=getattr(obj, "sampling_params", None),
        input_ids=input_ids,
        vocab_size=int(getattr(tokenizer_manager.model_config, "vocab_size", 0) or 0),
        generates=hasattr(obj, "return_logprob"),  # GenerateReqInput (embedding requests generate nothing)
    )
    if problem is not None:
        raise ValueError(problem)
    mark_parallel_sampling(getattr(obj, "sampling_params", None))


def mark_parallel_sampling(sampling_params) -> None:
    """A generating request with n > 1: SGLang warms its prefix up with a prefill-only copy sharing
    these custom_params; the mark tells the scheduler that copy is not a context to compact."""
    if not isinstance(sampling_params, dict):
        return
    n, max_new_tokens = sampling_params.get("n", 1), sampling_params.get("max_new_tokens")
    if isinstance(n, int) and n > 1 and max_new_tokens != 0:
        custom = sampling_params.get("custom_params")
        custom = dict(custom) if isinstance(custom, dict) else {}
        custom[GENERATING_MARK] = True
        sampling_params["custom_params"] = custom


def door_problem(*, rid, sampling_params, input_ids, vocab_size: int, generates: bool,
                 extension_active: bool = True) -> str | None:
    """Why a request must be refused before the scheduler (None: let it in). Pure, for the tests."""
    rids = rid if isinstance(rid, list) else [rid]
    if any(isinstance(r, str) and r.startswith(INTERNAL_RID_PREFIX) for r in rids):
        return f"rid must not start with {INTERNAL_RID_PREFIX!r} (reserved for the server's internal requests)"
    params = sampling_params if isinstance(sampling_params, dict) else {}
    custom = params.get("custom_params")
    if isinstance(custom, dict) and "kvx" in custom:
        try:
            fields = parse_request_fields(custom["kvx"])
        except SettingsError as exc:
            return str(exc)
        # Every field asking for something (``compact: false`` asks for what such a server does anyway).
        asked = [s.name for s in FIELD_SETTINGS
                 if s.name not in PASSIVE_FIELDS and getattr(fields, s.name) not in (None, False)]
        if asked and not extension_active:
            return (f"custom_params.kvx.{asked[0]}: this server runs without the KV extension, which would ignore it; "
                    f"launch it with --kvx-policy NAME or --kvx-decode-steps")
    if input_ids is not None and generates:
        if len(input_ids) == 0 and (params.get("max_new_tokens") is None or params.get("max_new_tokens") != 0):
            return "the prompt is empty: send text or input_ids with at least one token"
        if vocab_size and len(input_ids):
            low, high = min(input_ids), max(input_ids)
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                shown = bad if abs(bad) < 10**12 else f"a {len(str(abs(bad)))}-digit number"
                return f"input_ids must lie in [0, {vocab_size}) (the vocabulary); got {shown}"
    return None
