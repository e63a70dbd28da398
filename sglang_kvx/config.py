"""The ``--kvx-*`` flags as one validated, frozen config, and what a model offers a policy.

Validation runs in the launcher before any model is loaded: it reads only the
model's ``config.json`` to learn what the model can offer a policy. Which policies
exist, what they read and where they are safe comes from the policy registry alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any

from sglang_kvx.checkpoint import text_config
from sglang_kvx.checks import ServingFacts, decode_problem, policy_problem, with_checkpoint_tau
from sglang_kvx.decode import DECODE_STEPS, DecodeSettings
from sglang_kvx.decode.base import StepUnavailable
from sglang_kvx.policies import KVPolicy, ModelTraits, get_policy, policy_names, servable_policy_names
from sglang_kvx.schema import FLAG_SETTINGS, Setting, _short

logger = logging.getLogger(__name__)

GATED_MODEL_TYPE = "kvx_gated_gpt"  # the learned-gate family (models/gated.py takes its name from here)
GATED_ATTENTION_BACKEND = "kvx_gated"  # adapter/gated_backend.py


class KvxConfigError(ValueError):
    """A ``--kvx-*`` value that cannot be served; the message is one line for the user."""


class _ConfigMethods:
    @property
    def enabled(self) -> bool:
        """Whether the extension acts in this server (else SGLang runs exactly as without it)."""
        return get_policy(self.policy).compacts or self.decode_steps or self.sparse_budget > 0

    def to_dict(self) -> dict[str, Any]:
        """Every field's typed value (a decode step stays its DecodeSettings)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def report(self) -> dict[str, Any]:
        """Every field as JSON (what /kvx/stats shows): a decode step as its JSON object."""
        out = self.to_dict()
        if out["decode"] is not None:
            out["decode"] = {"step": out["decode"].step, **dict(out["decode"].options)}
        return out


def _flag_value(setting: Setting, raw: Any) -> Any:
    try:
        return setting.from_flag(raw)
    except ValueError as exc:
        raise KvxConfigError(str(exc)) from None


# The server config: one field per flag of the schema (its parsed default), then what launch derives.
KvxConfig = make_dataclass(
    "KvxConfig",
    [(s.config_attr, Any, field(default=s.from_flag(s.default))) for s in FLAG_SETTINGS] + [
        ("model_path", str, field(default="")),
        ("gate_tau", "float | None", field(default=None)),  # a gated checkpoint's frozen threshold (manifest ``tau``)
    ],
    bases=(_ConfigMethods,), frozen=True, namespace={"__module__": __name__, "__doc__":
        "A server's validated ``--kvx-*`` flags (``schema.SETTINGS``), the model path and its gate threshold."},
)


def flag_choices() -> list[str]:
    """What ``--kvx-policy`` accepts: ``none`` and every served policy of the registry."""
    return sorted({"none", *servable_policy_names()})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    # Kept as strings on the command line and parsed here, so a bad value gets our one-line error
    # rather than argparse's usage dump of every SGLang flag.
    # An on/off setting is also SGLang's store_true form: the flag alone means on.
    group = parser.add_argument_group("sglang_kvx (KV compaction)")
    for setting in FLAG_SETTINGS:
        switch = {"nargs": "?", "const": "on"} if setting.is_switch else {}
        group.add_argument(setting.flag, dest=setting.dest, type=str, default=setting.default,
                           help=setting.help_text().replace("%", "%%") + (" (default: %(default)s)" if setting.default else ""),
                           **switch)


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """Per layer "full_attention" or "linear_attention" (GDN), from the forms published checkpoints use:
    an explicit ``layer_types`` list (Qwen3.5), else ``full_attention_interval`` (Qwen3-Next: every
    k-th layer attends), else a dense model (every layer attends)."""
    cfg = text_config(cfg)
    n_layers = int(cfg.get("num_hidden_layers", 0))
    kinds = cfg.get("layer_types")
    if kinds:
        if len(kinds) != n_layers:
            raise KvxConfigError(f"config.json lists {len(kinds)} layer_types for {n_layers} layers")
        return ["linear_attention" if kind == "linear_attention" else "full_attention" for kind in kinds]
    interval = cfg.get("full_attention_interval")
    if interval and str(cfg.get("model_type", "")).startswith(("qwen3_next", "qwen3_5")):
        return ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention" for i in range(n_layers)]
    return ["full_attention"] * n_layers


def traits_of_config(cfg: dict[str, Any]) -> ModelTraits:
    """What a model offers a policy, from its config (as in ``config.json``)."""
    text = text_config(cfg)
    kinds = layer_kinds(cfg)
    attention_ids = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    gdn_ids = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    has_gdn = bool(gdn_ids)
    model_type = str(text.get("model_type", ""))
    arch = (cfg.get("architectures") or text.get("architectures") or [model_type or "this model"])[0]
    return ModelTraits(
        architecture=arch,
        num_attention_layers=len(attention_ids),
        num_kv_heads=int(text.get("num_key_value_heads", text.get("num_attention_heads", 0))),
        has_gdn=has_gdn,
        # Qwen3.5 / Qwen3-Next full-attention layers gate their output per head.
        has_output_gate=has_gdn and model_type.startswith(("qwen3_5", "qwen3_next")),
        attention_layer_ids=attention_ids,
        gdn_layer_ids=gdn_ids,
        gated_attention=str(text.get("attention", "")) if model_type == GATED_MODEL_TYPE else "",
        learned_gates=model_type == GATED_MODEL_TYPE and text.get("gate") == "gate",
    )


DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2}


def kv_bytes_per_token(model_path: str | None, traits: ModelTraits | None, dtype_bytes: float | None) -> int | None:
    """One token's keys and values over every attention layer (None: unknown); ``dtype_bytes`` None: the
    checkpoint's own dtype."""
    if traits is None or not model_path:
        return None
    cfg = text_config(json.loads((Path(model_path) / "config.json").read_text()))
    dtype_bytes = dtype_bytes or DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or ""))
    if not dtype_bytes:
        return None
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(1, cfg.get("num_attention_heads", 1))
    return int(2 * traits.num_attention_layers * traits.num_kv_heads * head_dim * dtype_bytes) or None


def model_traits(model_path: str | os.PathLike) -> ModelTraits | None:
    """What the model offers, from its ``config.json``; None when there is no local config to read."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    return traits_of_config(json.loads(config_file.read_text()))


def import_policy_modules(modules: str) -> None:
    """Import each comma-separated module: importing one registers the policies it defines."""
    import importlib

    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing module, a relative name ("..x"), or the module's own failure
            reason = (str(exc).splitlines() or [""])[0]
            reason = reason if len(reason) <= 160 else reason[:160] + "..."
            raise KvxConfigError(f"--kvx-policy-modules: cannot import {_short(name)} ({type(exc).__name__}: {reason})") from None


def build_config(policy: str = "none", keep_fraction: str | float = "1.0", model_path: str | None = None, *,
                 tp_size: int = 1, page_size: int = 1, attention_backend: str | None = None,
                 context_tokens: int | None = None, kv_dtype_bytes: float | None = None, **flags: Any) -> KvxConfig:
    """Validate raw flag values (the others of ``schema.FLAG_SETTINGS`` by name, as strings or values) and
    the server's facts (the model, when its config is local; ``context_tokens``, the longest prompt the
    server takes; ``kv_dtype_bytes``, a KV value's size) into a KvxConfig."""
    by_name = {s.name: s for s in FLAG_SETTINGS}
    unknown = sorted(set(flags) - set(by_name))
    if unknown:
        raise TypeError(f"build_config: unknown flag settings {', '.join(unknown)} (known: {', '.join(by_name)})")
    raw = {"policy": policy, "keep_fraction": keep_fraction, **flags}
    value = {s.name: (lambda s=s: _flag_value(s, raw.get(s.name, s.default))) for s in FLAG_SETTINGS}
    import_policy_modules(value["policy_modules"]())
    policy = value["policy"]()
    choices = ", ".join(flag_choices())
    if policy not in policy_names():
        raise KvxConfigError(f"unknown --kvx-policy {_short(policy)}; valid choices: {choices}")
    policy_cls = get_policy(policy)
    if policy not in flag_choices():
        raise KvxConfigError(f"--kvx-policy {policy} is not served yet (it scores offline); valid choices: {choices}")
    values = {by_name[name].config_attr: parse() for name, parse in value.items()}
    values["decode_steps"] = values["decode_steps"] or bool(values["decode"])
    if not (policy_cls.compacts or values["decode_steps"] or values["sparse_budget"]):
        # Nothing of the extension runs on such a server: a setting for it would silently do nothing.
        idle = [s.flag for s in FLAG_SETTINGS if s.name not in ("policy", "policy_modules", "decode_steps")
                and values[s.config_attr] != s.from_flag(s.default)]
        if idle:
            raise KvxConfigError(f"{idle[0]} has no effect: the server runs no --kvx-policy, decode-time steps or "
                                 f"block-sparse attention (add one, or drop {idle[0]})")
    config = KvxConfig(**values, model_path=str(model_path or ""))
    if config.sparse_budget and config.decode_steps:
        raise KvxConfigError("--kvx-sparse-attention cannot be combined with decode-time steps yet")
    if page_size > 1 and config.sparse_budget:
        raise KvxConfigError(f"block-sparse attention (--kvx-sparse-attention): not supported with --page-size "
                             f"{page_size} yet; serve with --page-size 1")
    check_context_dir(config, tp_size)
    traits = model_traits(model_path) if model_path else None
    check_tier_capacities(config, context_tokens, kv_bytes_per_token(model_path, traits, kv_dtype_bytes))
    if model_path and str(model_path).startswith(("/", "./", "../", "~")) and not Path(model_path).expanduser().exists():
        # A hub id cannot look like this; say so before SGLang asks the hub about it.
        raise KvxConfigError(f"--model-path {model_path} does not exist")
    # The checks a request's own settings meet too (checks.py), against this launch's facts.
    facts = ServingFacts(tp_size=tp_size, page_size=page_size, sparse_budget=config.sparse_budget,
                         model_signals=traits.signals if traits is not None else None,
                         model_name=traits.architecture if traits is not None else "this model")
    if problem := policy_problem(policy, policy_cls.allocation, facts, label=f"--kvx-policy {policy}",
                                 allocation_label=f"--kvx-policy {policy}: its allocation {policy_cls.allocation!r}"):
        raise KvxConfigError(problem)
    # The step's own needs: check_decode_for_model, below.
    if config.decode_steps and (problem := decode_problem(None, facts, label="--kvx-decode-steps" if not config.decode
                                                          else "--kvx-decode")):
        raise KvxConfigError(problem)
    gated = traits is not None and bool(traits.gated_attention)
    if gated and config.sparse_budget:
        raise KvxConfigError(f"--kvx-sparse-attention: {traits.architecture} computes its own gated attention, "
                             f"which has no block-sparse mode")
    if gated and attention_backend not in (None, GATED_ATTENTION_BACKEND):
        raise KvxConfigError(f"{traits.architecture} ({traits.gated_attention} attention with learned gates) needs "
                             f"--attention-backend {GATED_ATTENTION_BACKEND} (the default for it); got {attention_backend!r}")
    if attention_backend == GATED_ATTENTION_BACKEND and traits is not None and not gated:
        raise KvxConfigError(f"--attention-backend {GATED_ATTENTION_BACKEND} serves only the learned-gate family "
                             f"(kvx_gated_gpt); {traits.architecture} is not one")
    if traits is not None and traits.gated_attention and policy_cls.compacts:
        raise KvxConfigError(f"--kvx-policy {policy}: {traits.architecture} computes its own gated attention, which "
                             f"compaction policies cannot read yet; serve it with --kvx-decode sigmoid-gate")
    if policy_cls.compacts:
        make_policy(policy, config)  # a policy that cannot load (no estimator) fails now, not at the first request
    if traits is not None and traits.learned_gates:
        config = replace(config, gate_tau=read_gate_tau(model_path))
    if config.decode:
        config = replace(config, decode=check_decode_for_model(config, traits))
    if config.decode_steps:
        check_step_resources(config)  # a resource configured wrong, or the server's own step without one: fail now
    return config


def check_context_dir(config: KvxConfig, tp_size: int) -> None:
    """The disk tier's flags together: a directory of its own (or one that can be made) that this server
    can write and fsync, for the others to act on."""
    from sglang_kvx.store.context_file import MARKER, MARKER_TEXT, foreign_names, read_secret, write_atomic

    defaults = {s.name: s.from_flag(s.default) for s in FLAG_SETTINGS}
    if not config.context_dir:
        for name in ("disk_store_gb", "persist_contexts", "context_secret_file"):
            if getattr(config, name) != defaults[name]:
                raise KvxConfigError(f"--kvx-{name.replace('_', '-')} needs --kvx-context-dir (the directory the "
                                     f"disk tier writes to)")
        return
    path = Path(config.context_dir).expanduser()
    try:
        not_a_dir = path.exists() and not path.is_dir()
    except OSError as exc:  # a name the file system refuses (too long)
        raise KvxConfigError(f"--kvx-context-dir {_short(config.context_dir)}: {exc.strerror}") from None
    if not_a_dir:
        raise KvxConfigError(f"--kvx-context-dir {_short(config.context_dir)} is a file, not a directory")
    if tp_size > 1:
        raise KvxConfigError(f"--kvx-context-dir is not supported with --tp-size {tp_size} yet: each rank holds a "
                             f"head shard of a context, and the ranks do not agree on files yet")
    if config.disk_store_gb == 0:
        raise KvxConfigError("--kvx-disk-store-gb 0 leaves the disk tier no room; drop --kvx-context-dir to turn it off")
    try:
        read_secret(config.context_secret_file)
    except ValueError as exc:
        raise KvxConfigError(str(exc)) from None
    try:
        foreign = foreign_names(path) if path.is_dir() and not (path / MARKER).exists() else []
    except OSError as exc:
        raise KvxConfigError(f"--kvx-context-dir {_short(config.context_dir)}: cannot list it ({exc.strerror})") from None
    if foreign:
        # The server removes files of its own there; it must never mistake an operator's, or a model's, for one.
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise KvxConfigError(f"--kvx-context-dir {_short(config.context_dir)} holds files this server did not write "
                             f"({listed}); give it an empty directory of its own (it is created if missing)")
    try:  # the probe: the directory made, the marker written, fsynced and renamed into place
        path.mkdir(parents=True, exist_ok=True)
        write_atomic(path, MARKER, MARKER_TEXT.encode())
    except OSError as exc:
        if config.persist_contexts:
            raise KvxConfigError(f"--kvx-persist-contexts: --kvx-context-dir {_short(config.context_dir)} cannot be "
                                 f"written ({exc.strerror})") from None
        logger.warning("sglang_kvx: --kvx-context-dir %s cannot be written (%s): the disk tier only reads it",
                       config.context_dir, exc.strerror)


def check_tier_capacities(config: KvxConfig, context_tokens: int | None, kv_bytes_per_token: int | None) -> None:
    """Tiers that cannot hold one context of the longest this server takes (``context_tokens``) at its
    keep fraction, or host memory beyond the machine's: refused at launch instead of dropping every
    context, or swapping, later. Unknown sizes (no local model config) are not checked."""
    if config.host_store_gb:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if config.host_store_gb * 1e9 > physical:
            raise KvxConfigError(f"--kvx-host-store-gb {config.host_store_gb:g} is more than this machine's memory "
                                 f"({physical / 1e9:.1f} GB)")
    if not (context_tokens and kv_bytes_per_token and get_policy(config.policy).compacts):
        return
    one = math.ceil(context_tokens * config.keep_fraction) * kv_bytes_per_token
    for name, gb in (("host_store_gb", config.host_store_gb), ("disk_store_gb", config.disk_store_gb if config.context_dir else 0)):
        if gb and gb * 1e9 < one:
            raise KvxConfigError(f"--kvx-{name.replace('_', '-')} {gb:g} cannot hold one compacted context: "
                                 f"{context_tokens} tokens at --kvx-keep-fraction {config.keep_fraction:g} take "
                                 f"{one / 1e9:.3g} GB; give it at least that, or drop the flag")


def read_gate_tau(model_path: str | os.PathLike) -> float | None:
    """A gated checkpoint's frozen threshold: ``tau`` of its manifest.json (None: not frozen yet)."""
    manifest = Path(model_path) / "manifest.json"
    if not manifest.is_file():
        return None
    tau = json.loads(manifest.read_text()).get("tau")
    if tau is None:
        return None
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau < 1.0:
        raise KvxConfigError(f"{manifest}: tau must be a number in [0, 1), got {tau!r}")
    return float(tau)


def check_step_resources(config: KvxConfig) -> None:
    """Every decode step's server-wide resources (``DecodeStep.load_resources``: On-Demand Attention's recall
    head) from this launch's settings: wrong settings are refused, and so is ``--kvx-decode``'s step when this
    server cannot run it (a step merely unavailable is refused per request instead)."""
    default = config.decode.step if config.decode else None
    for name, step_class in DECODE_STEPS.items():
        try:
            step_class.load_resources(config)
        except StepUnavailable as why:
            if name == default:
                raise KvxConfigError(f"--kvx-decode {name}: {why}") from None
        except ValueError as exc:
            raise KvxConfigError(str(exc)) from None


def check_decode_for_model(config: KvxConfig, traits: ModelTraits | None) -> DecodeSettings:
    """The server's decode step against the model (``checks.decode_problem``): what it reads must be
    there; a gate step without a tau takes the checkpoint's. Returns the settings, completed."""
    settings = {"step": config.decode.step, **dict(config.decode.options)}
    facts = ServingFacts(model_signals=traits.signals if traits is not None else None,
                         model_name=traits.architecture if traits is not None else "this model")
    if problem := decode_problem(settings["step"], facts, label=f"--kvx-decode {settings['step']}"):
        raise KvxConfigError(problem)
    options = with_checkpoint_tau(settings["step"], settings, config.gate_tau)
    if options is None:
        raise KvxConfigError(f"--kvx-decode {settings['step']} needs a threshold: the checkpoint's manifest.json has "
                             f"no tau; pass --kvx-decode '{{\"step\": \"{settings['step']}\", \"tau\": 0.05}}'")
    return DecodeSettings(settings["step"], tuple(sorted((k, v) for k, v in options.items() if k != "step")))


def make_policy(name: str, config: KvxConfig) -> KVPolicy:
    """The policy object a server applies; a policy that cannot load (GateSight without estimators
    for this model) raises KvxConfigError with the reason."""
    try:
        return get_policy(name).from_config(config)
    except (ValueError, FileNotFoundError) as exc:
        raise KvxConfigError(str(exc)) from None
