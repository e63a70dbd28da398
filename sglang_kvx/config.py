"""The ``--kvx-*`` flags as one validated, frozen config.

Validation runs in the launcher before any model is loaded: it reads only the
model's ``config.json`` to learn what the model can offer a policy.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_kvx.policies import ModelTraits, get_policy, policy_names

# Policies the server can apply today: those reading keys and values (SGLang's
# pool holds them), attention or query statistics (queries captured during the
# parent's prefill), GDN signals / output gates (captured the same way), and
# KVzip's reconstruction (internal second-pass requests, compact/second_pass.py).
# Per-layer budgets (pyramidkv) need the kvx_torch_native attention backend.
# A registered policy outside this set scores offline only (choose_keep_set, the
# HF oracle); the launcher refuses it rather than accept it and do nothing.
SERVABLE_POLICIES: frozenset[str] = frozenset(
    {"none", "random", "knorm", "streamingllm", "keydiff", "snapkv", "h2o", "pyramidkv", "triattention", "gatesight", "kvzip"}
)

# Each flag: (dest, default, help). Kept as strings on the command line and
# parsed here, so a bad value gets our one-line error rather than argparse's
# usage dump of every SGLang flag.
FLAGS: dict[str, tuple[str, str]] = {
    "kvx_policy": ("none", "KV policy applied after a context's prefill ('none' = plain SGLang)."),
    "kvx_keep_fraction": ("1.0", "Fraction p in (0, 1] of a context's KV entries each compacted context keeps."),
    "kvx_protected_prefix_len": ("0", "Leading tokens of every compacted context kept outside the budget (per request: custom_params.kvx.protected_prefix_len)."),
    "kvx_estimator": ("", "GateSight estimator folder (default: the one trained for --model-path, in <model>/gatesight or weights/gatesight/)."),
}


class KvxConfigError(ValueError):
    """A ``--kvx-*`` value that cannot be served; the message is one line for the user."""


@dataclass(frozen=True)
class KvxConfig:
    policy: str = "none"
    keep_fraction: float = 1.0
    protected_prefix_len: int = 0
    estimator: str = ""  # GateSight estimator folder; "" = find the one trained for the model
    model_path: str = ""

    @property
    def enabled(self) -> bool:
        return get_policy(self.policy).compacts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def model_traits(model_path: str | os.PathLike) -> ModelTraits | None:
    """What the model offers, from its ``config.json``; None when there is no local config to read."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    cfg = json.loads(config_file.read_text())
    cfg = cfg.get("text_config", cfg)
    layer_types = cfg.get("layer_types") or []
    has_gdn = "linear_attention" in layer_types
    n_layers = int(cfg.get("num_hidden_layers", 0))
    n_attn = sum(t == "full_attention" for t in layer_types) if layer_types else n_layers
    arch = (cfg.get("architectures") or [cfg.get("model_type", "this model")])[0]
    return ModelTraits(
        architecture=arch,
        num_attention_layers=n_attn,
        num_kv_heads=int(cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 0))),
        has_gdn=has_gdn,
        # Qwen3.5 / Qwen3-Next full-attention layers gate their output per head.
        has_output_gate=has_gdn and cfg.get("model_type", "").startswith(("qwen3_5", "qwen3_next")),
    )


def parse_protected_prefix_len(raw: str | int) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise KvxConfigError(f"--kvx-protected-prefix-len must be a whole number >= 0, got {raw!r}") from None
    if value < 0:
        raise KvxConfigError(f"--kvx-protected-prefix-len must be >= 0, got {value}")
    return value


def build_config(
    policy: str = "none",
    keep_fraction: str | float = 1.0,
    model_path: str | None = None,
    protected_prefix_len: str | int = 0,
    estimator: str = "",
) -> KvxConfig:
    """Validate raw flag values (and the model, when its config is local) into a KvxConfig."""
    servable = ", ".join(sorted(SERVABLE_POLICIES))
    if policy not in policy_names():
        raise KvxConfigError(f"unknown --kvx-policy {policy!r}; valid choices: {servable}")
    if policy not in SERVABLE_POLICIES:
        raise KvxConfigError(
            f"--kvx-policy {policy} is not served yet (it scores offline); valid choices: {servable}"
        )
    policy_cls = get_policy(policy)
    config = KvxConfig(
        policy=policy,
        keep_fraction=parse_keep_fraction(keep_fraction),
        protected_prefix_len=parse_protected_prefix_len(protected_prefix_len),
        estimator=str(estimator or ""),
        model_path=str(model_path or ""),
    )
    if model_path and str(model_path).startswith(("/", "./", "../", "~")) and not Path(model_path).expanduser().exists():
        # A hub id cannot look like this; say so before SGLang asks the hub about it.
        raise KvxConfigError(f"--model-path {model_path} does not exist")
    traits = model_traits(model_path) if model_path else None
    if traits is not None:
        try:
            policy_cls.check_model(traits)
        except ValueError as exc:
            raise KvxConfigError(str(exc)) from None
    if policy == "gatesight" or estimator:
        make_policy(policy, config)  # finds and checks the estimator now, not at the first request
    return config


# Under tensor parallelism every rank compacts its own KV heads and all ranks must agree on each
# layer's budget and on every internal request. These would not (yet): the gate allocation reads
# the rank's own query heads, GateSight's estimators index global KV heads, and KVzip's second pass
# queues requests from inside one scheduler.
TP_UNSUPPORTED = {
    "gatesight": "its estimators and gate budgets are per global KV / query head",
    "kvzip": "its second pass queues internal requests from inside the scheduler",
    "gate": "each rank would average only its own query heads' gates",
}


def check_tensor_parallel(policy: str, allocation: str | None, tp_size: int) -> None:
    """Refuse, with the reason, a policy or allocation that is not rank-consistent under --tp-size > 1."""
    if tp_size <= 1:
        return
    for name, kind in ((policy, "policy"), (allocation, "allocation")):
        if name in TP_UNSUPPORTED:
            raise KvxConfigError(f"kvx {kind} {name!r} is not supported with --tp-size {tp_size} yet: {TP_UNSUPPORTED[name]}")


def request_kvx_params(sampling_params: Any) -> dict[str, Any]:
    """A request's ``custom_params["kvx"]`` overrides ({} when it sends none)."""
    custom = getattr(sampling_params, "custom_params", None) or {}
    params = custom.get("kvx") if isinstance(custom, dict) else None
    return params if isinstance(params, dict) else {}


def marks_context(sampling_params: Any) -> bool:
    """Whether a request is a parent, a context to compact: prefill-only (how SGLang's frontend
    commits a shared prefix) unless ``{"kvx": {"compact": ...}}`` says otherwise."""
    params = request_kvx_params(sampling_params)
    if "compact" in params:
        return bool(params["compact"])
    return getattr(sampling_params, "max_new_tokens", None) == 0


def policy_options(name: str, config: KvxConfig) -> dict[str, Any]:
    """Constructor options a served policy takes from the server's config."""
    if name == "gatesight":
        return {"estimator": config.estimator or None, "model_path": config.model_path or None}
    return {}


def make_policy(name: str, config: KvxConfig):
    """The policy object a server applies; a policy that cannot load (GateSight without estimators
    for this model) raises KvxConfigError with the reason."""
    try:
        return get_policy(name)(**policy_options(name, config))
    except (ValueError, FileNotFoundError) as exc:
        raise KvxConfigError(str(exc)) from None
