"""The ``--kvx-*`` flags as one validated, frozen config, and what a model offers a policy.

Validation runs in the launcher before any model is loaded: it reads only the
model's ``config.json`` to learn what the model can offer a policy. Which policies
exist, what they read and where they are safe comes from the policy registry alone.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sglang_kvx.allocate import allocation_tp_problem
from sglang_kvx.checkpoint import text_config
from sglang_kvx.policies import KVPolicy, ModelTraits, get_policy, policy_names, servable_policy_names

# Each flag: (dest, default, help). Kept as strings on the command line and
# parsed here, so a bad value gets our one-line error rather than argparse's
# usage dump of every SGLang flag.
FLAGS: dict[str, tuple[str, str]] = {
    "kvx_policy": ("none", "KV policy applied after a context's prefill ('none' = plain SGLang)."),
    "kvx_keep_fraction": ("1.0", "Fraction p in (0, 1] of a context's KV entries each compacted context keeps."),
    "kvx_protected_prefix_len": ("0", "Leading tokens of every compacted context kept outside the budget (per request: custom_params.kvx.protected_prefix_len)."),
    "kvx_estimator": ("", "GateSight estimator folder (default: the one trained for --model-path, in <model>/gatesight or weights/gatesight/)."),
    "kvx_min_store_fraction": ("0.25", "Share of the KV pool kept for compacted contexts: the most recently used ones within it are never evicted to make room."),
    "kvx_decode_steps": ("off", "'on': requests may ask for a decode-time step (custom_params.kvx.decode: StreamingLLM eviction, span schedules, On-Demand Attention, learned-gate and online H2O / KeyDiff eviction)."),
    "kvx_decode": ("", "A decode-time step every generating request runs unless it names its own (custom_params.kvx.decode): a step name (oda, streamingllm, span_schedule, sigmoid-gate, h2o, keydiff) or a JSON object with its options, e.g. '{\"step\": \"oda\", \"window\": 128, \"theta\": 0.5}'. Implies --kvx-decode-steps on."),
    "kvx_auto_context_min_tokens": ("0", "Compact, unasked, the beginning plain requests keep repeating once it is at least this many tokens (a document asked about without marking it; SGLang's threaded frontend fork); 0 = off (such prefixes are only logged)."),
    "kvx_oda_head": ("", "On-Demand Attention's recall head folder (default: the one trained for --model-path, in <model>/oda or weights/oda/<model folder name>)."),
    "kvx_sparse_attention": ("0", "Block-sparse attention for every request: each query attends to this many tokens (a multiple of 4, at least 8), in four-token blocks -- the first, its own and the best others by a mean-key indexer; 0 = dense attention."),
    "kvx_policy_modules": ("", "Comma-separated Python modules imported first in every server process: each registers its own policies with @register_policy."),
}


GATED_MODEL_TYPE = "kvx_gated_gpt"  # the learned-gate family (models/gated.py takes its name from here)
GATED_ATTENTION_BACKEND = "kvx_gated"  # adapter/gated_backend.py


class KvxConfigError(ValueError):
    """A ``--kvx-*`` value that cannot be served; the message is one line for the user."""


@dataclass(frozen=True)
class KvxConfig:
    policy: str = "none"
    keep_fraction: float = 1.0
    protected_prefix_len: int = 0
    estimator: str = ""  # GateSight estimator folder; "" = find the one trained for the model
    model_path: str = ""
    policy_modules: str = ""  # comma-separated modules registering further policies (imported in every process)
    decode_steps: bool = False  # requests may ask for decode-time steps
    decode: str = ""  # the server's default decode step, as canonical JSON ("" = none)
    oda_head: str = ""  # the recall head folder for On-Demand Attention ("" = none found)
    auto_context_min_tokens: int = 0  # compact repeated plain-request beginnings this long (0 = off)
    min_store_fraction: float = 0.25  # share of the pool reserved for compacted contexts
    gate_tau: float | None = None  # a gated checkpoint's frozen eviction threshold (manifest ``tau``)
    sparse_budget: int = 0  # block-sparse attention: tokens each query attends to (0 = dense)

    @property
    def enabled(self) -> bool:
        """Whether the extension acts in this server (else SGLang runs exactly as without it)."""
        return get_policy(self.policy).compacts or self.decode_steps or self.sparse_budget > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flag_choices() -> list[str]:
    """What ``--kvx-policy`` accepts: ``none`` and every served policy of the registry."""
    return sorted({"none", *servable_policy_names()})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sglang_kvx (KV compaction)")
    for dest, (default, help_text) in FLAGS.items():
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, type=str, default=default, help=help_text)


def parse_keep_fraction(raw: str | float) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise KvxConfigError(f"--kvx-keep-fraction must be a number in (0, 1], got {raw!r}") from None
    if not 0.0 < value <= 1.0:
        raise KvxConfigError(f"--kvx-keep-fraction must be in (0, 1], got {value:g}")
    return value


def parse_protected_prefix_len(raw: str | int) -> int:
    return parse_count(raw, "--kvx-protected-prefix-len")


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


def model_traits(model_path: str | os.PathLike) -> ModelTraits | None:
    """What the model offers, from its ``config.json``; None when there is no local config to read."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    return traits_of_config(json.loads(config_file.read_text()))


def parse_store_fraction(raw: str | float) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise KvxConfigError(f"--kvx-min-store-fraction must be a number in [0, 1), got {raw!r}") from None
    if not 0.0 <= value < 1.0:
        raise KvxConfigError(f"--kvx-min-store-fraction must be in [0, 1), got {value:g}")
    return value


def parse_count(raw: str | int, flag: str) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise KvxConfigError(f"{flag} must be a whole number >= 0, got {raw!r}") from None
    if value < 0:
        raise KvxConfigError(f"{flag} must be a whole number >= 0, got {value}")
    return value


def parse_sparse_budget(raw: str | int) -> int:
    from sglang_kvx.ops.block_sparse import BLOCK

    budget = parse_count(raw, "--kvx-sparse-attention")
    if budget and (budget % BLOCK or budget < 2 * BLOCK):
        raise KvxConfigError(f"--kvx-sparse-attention must be 0 or a multiple of {BLOCK} of at least {2 * BLOCK} "
                             f"(the first block and a query's own), got {budget}")
    return budget


def parse_on_off(raw: str | bool, flag: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if raw not in ("on", "off"):
        raise KvxConfigError(f"{flag} must be 'on' or 'off', got {raw!r}")
    return raw == "on"


def parse_decode_flag(raw: str) -> str:
    """``--kvx-decode``: a step name or a JSON object of a step and its options -> canonical JSON."""
    from sglang_kvx.decode import parse_decode_settings

    raw = (raw or "").strip()
    if not raw:
        return ""
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise KvxConfigError(f"--kvx-decode is not valid JSON ({exc.msg})") from None
    else:
        value = {"step": raw}
    try:
        settings = parse_decode_settings(value, field="--kvx-decode")
    except ValueError as exc:
        raise KvxConfigError(str(exc)) from None
    return json.dumps({"step": settings.step, **dict(settings.options)}, sort_keys=True)


def find_recall_head(model_path: str, explicit: str = "") -> str:
    """The recall head folder to serve: ``explicit``, else ``<model>/oda``, else
    ``weights/oda/<model folder name>`` beside this package ("" when none exists)."""
    if explicit:
        if not (Path(explicit) / "manifest.json").exists():
            raise KvxConfigError(f"--kvx-oda-head {explicit}: no manifest.json there")
        return explicit
    if not model_path:
        return ""
    model = Path(model_path).expanduser()
    for candidate in (model / "oda", Path(__file__).resolve().parent.parent / "weights" / "oda" / model.resolve().name):
        if (candidate / "manifest.json").exists():
            return str(candidate)
    return ""


def import_policy_modules(modules: str) -> None:
    """Import each comma-separated module: importing one registers the policies it defines."""
    import importlib

    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise KvxConfigError(f"--kvx-policy-modules: cannot import {name!r} ({exc})") from None


def build_config(
    policy: str = "none",
    keep_fraction: str | float = 1.0,
    model_path: str | None = None,
    protected_prefix_len: str | int = 0,
    estimator: str = "",
    tp_size: int = 1,
    policy_modules: str = "",
    decode_steps: str | bool = "off",
    min_store_fraction: str | float = 0.25,
    decode: str = "",
    oda_head: str = "",
    auto_context_min_tokens: str | int = 0,
    attention_backend: str | None = None,
    sparse_attention: str | int = 0,
    page_size: int = 1,
) -> KvxConfig:
    """Validate raw flag values (and the model, when its config is local) into a KvxConfig."""
    import_policy_modules(policy_modules)
    choices = ", ".join(flag_choices())
    if policy not in policy_names():
        raise KvxConfigError(f"unknown --kvx-policy {policy!r}; valid choices: {choices}")
    policy_cls = get_policy(policy)
    if policy not in flag_choices():
        raise KvxConfigError(f"--kvx-policy {policy} is not served yet (it scores offline); valid choices: {choices}")
    if tp_size > 1 and policy_cls.tp_unsafe:
        raise KvxConfigError(f"kvx policy {policy!r} is not supported with --tp-size {tp_size} yet: {policy_cls.tp_unsafe}")
    if tp_size > 1 and policy_cls.compacts and (problem := allocation_tp_problem(policy_cls.allocation)):
        raise KvxConfigError(f"kvx policy {policy!r}: its allocation {policy_cls.allocation!r} is not supported with "
                             f"--tp-size {tp_size} yet: {problem}")
    config = KvxConfig(
        policy=policy,
        keep_fraction=parse_keep_fraction(keep_fraction),
        protected_prefix_len=parse_protected_prefix_len(protected_prefix_len),
        estimator=str(estimator or ""),
        model_path=str(model_path or ""),
        policy_modules=str(policy_modules or ""),
        decode_steps=parse_on_off(decode_steps, "--kvx-decode-steps") or bool(parse_decode_flag(decode)),
        min_store_fraction=parse_store_fraction(min_store_fraction),
        decode=parse_decode_flag(decode),
        oda_head=find_recall_head(str(model_path or ""), str(oda_head or "")),
        auto_context_min_tokens=parse_count(auto_context_min_tokens, "--kvx-auto-context-min-tokens"),
        sparse_budget=parse_sparse_budget(sparse_attention),
    )
    if config.sparse_budget and config.decode_steps:
        raise KvxConfigError("--kvx-sparse-attention cannot be combined with decode-time steps yet")
    if page_size > 1:
        # Compaction fills whole pages (allocate.fill_pages); these free or hold slots one at a time.
        if policy_cls.second_pass:
            raise KvxConfigError(f"kvx policy {policy!r} is not supported with --page-size {page_size} yet: its "
                                 f"reconstruction passes hold the context in slots that are not whole pages")
        for refused, what in ((config.decode_steps, "decode-time steps (--kvx-decode, --kvx-decode-steps)"),
                              (config.sparse_budget, "block-sparse attention (--kvx-sparse-attention)")):
            if refused:
                raise KvxConfigError(f"{what}: not supported with --page-size {page_size} yet; serve with --page-size 1")
    if model_path and str(model_path).startswith(("/", "./", "../", "~")) and not Path(model_path).expanduser().exists():
        # A hub id cannot look like this; say so before SGLang asks the hub about it.
        raise KvxConfigError(f"--model-path {model_path} does not exist")
    traits = model_traits(model_path) if model_path else None
    if traits is not None:
        try:
            policy_cls.check_model(traits)
        except ValueError as exc:
            raise KvxConfigError(str(exc)) from None
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
    if config.decode and json.loads(config.decode)["step"] == "oda":
        load_recall_head(config)  # no head, or one trained for another model: fail now
    return config


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


def check_decode_for_model(config: KvxConfig, traits: ModelTraits | None) -> str:
    """The server's decode step against the model: what it reads must be there; a gate step without
    a tau takes the checkpoint's. Returns the canonical JSON, completed."""
    from sglang_kvx.decode import DECODE_STEPS

    settings = json.loads(config.decode)
    step = DECODE_STEPS[settings["step"]]
    if traits is not None and step.needs - traits.signals:
        raise KvxConfigError(f"--kvx-decode {settings['step']} needs {', '.join(sorted(step.needs))}, which "
                             f"{traits.architecture} does not provide (serve {step.model_hint or 'a model that does'})")
    if "tau" in step.real_options and "tau" not in settings:
        if config.gate_tau is None:
            raise KvxConfigError(f"--kvx-decode {settings['step']} needs a threshold: the checkpoint's manifest.json has "
                                 f"no tau; pass --kvx-decode '{{\"step\": \"{settings['step']}\", \"tau\": 0.05}}'")
        settings["tau"] = config.gate_tau
    return json.dumps(settings, sort_keys=True)


def load_recall_head(config: KvxConfig):
    """The recall head On-Demand Attention routes with, checked against the served model."""
    from sglang_kvx.decode.recall_head import RecallHead

    if not config.oda_head:
        raise KvxConfigError(f"On-Demand Attention needs a recall head trained for {config.model_path or 'this model'}: "
                             f"none in <model>/oda or weights/oda/; pass --kvx-oda-head or train one "
                             f"(python -m sglang_kvx.training.train_recall_head)")
    try:
        return RecallHead.from_pretrained(config.oda_head, config.model_path) if config.model_path else None
    except (ValueError, OSError, KeyError) as exc:
        raise KvxConfigError(f"--kvx-oda-head: {exc}") from None


def make_policy(name: str, config: KvxConfig) -> KVPolicy:
    """The policy object a server applies; a policy that cannot load (GateSight without estimators
    for this model) raises KvxConfigError with the reason."""
    try:
        return get_policy(name).from_config(config)
    except (ValueError, FileNotFoundError) as exc:
        raise KvxConfigError(str(exc)) from None
