"""Every setting of the extension, declared once: its ``--kvx-*`` flag, its ``custom_params.kvx``
request field, its default, its range, its help and its parsing.

From ``SETTINGS`` come the launcher's flags and their help (``config.add_cli_args``), the server
config's fields (``config.KvxConfig``), ``Engine``'s keyword arguments (``adapter/engine.py``), the
door's parsing of a request's fields and its messages (``settings.parse_request_fields``) and the
hostile-input battery the tests run against every flag. The checks of a value against the model and
the server's other flags stay where those facts are known (``config.build_config`` at launch,
``settings.resolve_settings`` per request).

A flag arrives as a string (the command line, or an ``Engine`` keyword): ``from_flag`` parses it and
raises ``ValueError`` with a one-line message naming the flag. A request field arrives as JSON:
``from_field`` checks its type strictly (``"0.5"`` is not a number, ``true`` is not 1) and raises
``ValueError`` naming ``custom_params.kvx.<field>``; None means not sent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FIELD_PREFIX = "custom_params.kvx"
MAX_NAME_LENGTH = 64
MAX_TOKENS = (1 << 31) - 1  # SGLang's token positions are int32
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


@dataclass(frozen=True)
class Setting:
    """One setting. ``flag``: it is a launcher flag (``--kvx-<name>``), parsed by ``from_flag`` into the
    server config's ``attr``; ``from_field``: it is a request field (``custom_params.kvx.<name>``)."""

    name: str
    help: str
    default: str | None = None  # the flag's default, as typed on a command line
    from_flag: Callable[[str], Any] | None = None
    attr: str = ""  # the server config's attribute ("" = name)
    from_field: Callable[[Any], Any] | None = None

    @property
    def flag(self) -> str:
        return "--kvx-" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """argparse's attribute for the flag, and ``Engine``'s keyword."""
        return "kvx_" + self.name

    @property
    def config_attr(self) -> str:
        return self.attr or self.name


# --- values on the command line ---------------------------------------------------------------------


def _text(raw: str) -> str:
    return str(raw or "")


def flag_path(raw: str, flag: str) -> str:
    """A file system path ("" = none): at most 4096 characters, none of them NUL (what the OS takes)."""
    path = str(raw or "")
    if len(path) > 4096 or "\0" in path:
        raise ValueError(f"{flag} must be a path of at most 4096 characters, got {_short(path)}")
    return path


def flag_fraction(raw: str | float, flag: str = "--kvx-keep-fraction", low_open: bool = True) -> float:
    """A number in (0, 1] (``low_open``) or [0, 1)."""
    bounds = "(0, 1]" if low_open else "[0, 1)"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a number in {bounds}, got {_short(raw)}") from None
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value < 1.0):
        raise ValueError(f"{flag} must be in {bounds}, got {value:g}")
    return value


def flag_count(raw: str | int, flag: str, limit: int = MAX_TOKENS) -> int:
    """A whole number in [0, limit]."""
    try:
        value = int(raw)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{flag} must be a whole number >= 0, got {_short(raw)}") from None
    if value < 0:
        raise ValueError(f"{flag} must be a whole number >= 0, got {value}")
    if value > limit:
        raise ValueError(f"{flag} must be at most {limit}, got {_short(value)}")
    return value


def flag_real(raw: str | float, flag: str, limit: float = 1e6) -> float | None:
    """A finite number in [-limit, limit], or "" for none (the default comes from elsewhere)."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{flag} must be a number, got {_short(raw)}") from None
    if not -limit <= value <= limit:  # NaN fails both comparisons
        raise ValueError(f"{flag} must be a finite number in [-{limit:g}, {limit:g}], got {_short(raw)}")
    return value


def flag_gigabytes(raw: str | float, flag: str, limit: float = 1 << 20) -> float:
    """A size in GB in [0, limit] (0 = off): a finite number, so a typo never sizes a tier at infinity."""
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{flag} must be a number of GB >= 0, got {_short(raw)}") from None
    if not 0.0 <= value <= limit:  # NaN fails both comparisons
        raise ValueError(f"{flag} must be a number of GB in [0, {limit:g}], got {_short(raw)}")
    return value


def flag_on_off(raw: str | bool, flag: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if raw not in ("on", "off"):
        raise ValueError(f"{flag} must be 'on' or 'off', got {_short(raw)}")
    return raw == "on"


def flag_sparse_budget(raw: str | int) -> int:
    from sglang_kvx.ops.block_layout import BLOCK

    budget = flag_count(raw, "--kvx-sparse-attention")
    if budget and (budget % BLOCK or budget < 2 * BLOCK):
        raise ValueError(f"--kvx-sparse-attention must be 0 or a multiple of {BLOCK} of at least {2 * BLOCK} "
                         f"(the first block and a query's own), got {budget}")
    return budget


def flag_decode(raw: str) -> str:
    """``--kvx-decode``: a step name or a JSON object of a step and its options -> canonical JSON."""
    from sglang_kvx.decode import parse_decode_settings

    raw = (raw or "").strip()
    if not raw:
        return ""
    if raw.startswith("{"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kvx-decode is not valid JSON ({exc.msg})") from None
    else:
        value = {"step": raw}
    settings = parse_decode_settings(value, field="--kvx-decode")
    return json.dumps({"step": settings.step, **dict(settings.options)}, sort_keys=True)


# --- values in a request ----------------------------------------------------------------------------


def _short(value: Any) -> str:
    """A value for an error message: its type for containers and long strings, never the value."""
    if isinstance(value, (dict, list, tuple)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    if isinstance(value, str):
        return repr(value) if len(value) <= 32 else f"a string of {len(value)} characters"
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    text = repr(value)
    return text if len(text) <= 32 else f"a number of {len(text)} digits"


def field_name(field: str, choices: Callable[[], list[str]]) -> Callable[[Any], str | None]:
    def parse(value: Any) -> str | None:
        if value is None:
            return None
        valid = choices()
        if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or value not in valid:
            raise ValueError(f"{FIELD_PREFIX}.{field} must be a string naming one of the valid choices: "
                             f"{', '.join(valid)}; got {_short(value)}")
        return value

    return parse


def field_fraction(field: str) -> Callable[[Any], float | None]:
    def parse(value: Any) -> float | None:
        if value is None:
            return None
        # bool is an int in Python and "0.5" is not a number: both are refused, not coerced.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(f"{FIELD_PREFIX}.{field} must be a number in (0, 1]; got {_short(value)}")
        return float(value)

    return parse


def field_count(field: str, limit: int = MAX_TOKENS) -> Callable[[Any], int | None]:
    def parse(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise ValueError(f"{FIELD_PREFIX}.{field} must be a whole number in [0, {limit}]; got {_short(value)}")
        return value

    return parse


def field_bool(field: str) -> Callable[[Any], bool | None]:
    def parse(value: Any) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{FIELD_PREFIX}.{field} must be true or false; got {_short(value)}")
        return value

    return parse


def field_tenant(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or TENANT_PATTERN.fullmatch(value) is None:
        raise ValueError(f"{FIELD_PREFIX}.tenant must be a string of 1 to 64 letters, digits or ._:@-; "
                         f"got {_short(value)}")
    return value


def field_decode(value: Any):
    from sglang_kvx.decode import parse_decode_settings

    return parse_decode_settings(value, field=f"{FIELD_PREFIX}.decode")


def _policy_names() -> list[str]:
    from sglang_kvx.policies import servable_policy_names

    return servable_policy_names()


def _allocation_names() -> list[str]:
    from sglang_kvx.allocate import allocation_names

    return allocation_names()


# --- the settings -----------------------------------------------------------------------------------

SETTINGS: tuple[Setting, ...] = (
    Setting("policy", "KV policy applied after a context's prefill ('none' = plain SGLang).",
            "none", _text, from_field=field_name("policy", _policy_names)),
    Setting("keep_fraction", "Fraction p in (0, 1] of a context's KV entries each compacted context keeps.",
            "1.0", flag_fraction, from_field=field_fraction("keep_fraction")),
    Setting("protected_prefix_len", "Leading tokens of every compacted context kept outside the budget "
            "(per request: custom_params.kvx.protected_prefix_len).",
            "0", lambda raw: flag_count(raw, "--kvx-protected-prefix-len"), from_field=field_count("protected_prefix_len")),
    Setting("allocation", "How a context's budget is shared out over layers and KV heads (default: the policy's).",
            from_field=field_name("allocation", _allocation_names)),
    Setting("compact", "false: this parent keeps its full cache (no policy runs on it).", from_field=field_bool("compact")),
    Setting("decode", "A decode-time step every generating request runs unless it names its own "
            "(custom_params.kvx.decode): a step name (oda, streamingllm, span_schedule, sigmoid-gate, h2o, keydiff, kvzap, "
            "kvzap_linear) "
            "or a JSON object with its options, e.g. '{\"step\": \"oda\", \"window\": 128, \"theta\": 0.5}'. "
            "Implies --kvx-decode-steps on.", "", flag_decode, from_field=field_decode),
    Setting("tenant", "Whose contexts these are: each tenant's share of the store's reserve is its own.",
            from_field=field_tenant),
    Setting("estimator", "GateSight estimator folder (default: the one trained for --model-path, in "
            "<model>/gatesight or weights/gatesight/).", "", lambda raw: flag_path(raw, "--kvx-estimator")),
    Setting("min_store_fraction", "Share of the KV pool kept for compacted contexts: the most recently used ones "
            "within it are never evicted to make room.",
            "0.25", lambda raw: flag_fraction(raw, "--kvx-min-store-fraction", low_open=False)),
    Setting("reserved_tenants", "Tenants (custom_params.kvx.tenant) with a share of that reserve of their own, "
            "first come first served (a tenant keeps its seat while it holds a context); every other tenant shares "
            "one more share with untagged requests, so inventing tenant names cannot dilute a seated tenant's share.",
            "8", lambda raw: flag_count(raw, "--kvx-reserved-tenants", limit=4096)),
    Setting("decode_steps", "'on': requests may ask for a decode-time step (custom_params.kvx.decode: StreamingLLM "
            "eviction, span schedules, On-Demand Attention, learned-gate, online H2O / KeyDiff and KVzap eviction).",
            "off", lambda raw: flag_on_off(raw, "--kvx-decode-steps")),
    Setting("auto_context_min_tokens", "Compact, unasked, the beginning plain requests keep repeating once it is at "
            "least this many tokens (a document asked about without marking it; SGLang's threaded frontend fork); "
            "0 = off (such prefixes are only logged).",
            "0", lambda raw: flag_count(raw, "--kvx-auto-context-min-tokens")),
    Setting("oda_head", "On-Demand Attention's recall head folder (default: the one trained for --model-path, in "
            "<model>/oda or weights/oda/<model folder name>).", "", lambda raw: flag_path(raw, "--kvx-oda-head")),
    Setting("kvzap_surrogates", "KVzap's surrogate folder, holding mlp/ and linear/ (default: the ones trained for "
            "--model-path, in <model>/kvzap or weights/kvzap/).", "", lambda raw: flag_path(raw, "--kvx-kvzap-surrogates")),
    Setting("kvzap_threshold", "KVzap's threshold tau on each entry's predicted log KVzip+ score: entries under it are "
            "dropped (default: the surrogate manifest's).", "", lambda raw: flag_real(raw, "--kvx-kvzap-threshold")),
    Setting("kvzap_window", "KVzap's window: the last N tokens of a context are always kept.", "128",
            lambda raw: flag_count(raw, "--kvx-kvzap-window")),
    Setting("sparse_attention", "Block-sparse attention for every request: each query attends to this many tokens "
            "(a multiple of 4, at least 8), in four-token blocks -- the first, its own and the best others by a "
            "mean-key indexer; 0 = dense attention.", "0", flag_sparse_budget, attr="sparse_budget"),
    Setting("host_store_gb", "Host memory (GB) for compacted contexts evicted from the KV pool: a child of one is "
            "served by copying its kept entries back instead of a new prefill and compaction; least recently used "
            "first out; 0 = off (an evicted context is dropped).",
            "0", lambda raw: flag_gigabytes(raw, "--kvx-host-store-gb")),
    Setting("context_dir", "Directory for compacted contexts on disk: those host memory lets go (or the pool evicts, "
            "without a host tier) are written there as safetensors plus a JSON manifest, and a child of one -- on "
            "this server, after a restart, or on another server of the same model sharing the path -- restores it "
            "instead of a new prefill; \"\" = off.", "", lambda raw: flag_path(raw, "--kvx-context-dir")),
    Setting("disk_store_gb", "Disk space (GB) this model's context files may take in --kvx-context-dir; least "
            "recently used first out.", "16", lambda raw: flag_gigabytes(raw, "--kvx-disk-store-gb")),
    Setting("persist_contexts", "'on': every compacted context is written to --kvx-context-dir as soon as it is "
            "stored, so it outlives the process (kill -9 included); 'off': only evicted ones are.",
            "off", lambda raw: flag_on_off(raw, "--kvx-persist-contexts")),
    Setting("context_secret_file", "A file holding a secret (16+ bytes) shared by the servers on --kvx-context-dir: "
            "every manifest they write carries an HMAC with it, and a file without a valid one is refused (a process "
            "that can write the directory but not read this file cannot make a server serve its bytes).",
            "", lambda raw: flag_path(raw, "--kvx-context-secret-file")),
    Setting("policy_modules", "Comma-separated Python modules imported first in every server process: each "
            "registers its own policies (@register_policy), decode steps (@register_decode_step) and signals "
            "(@register_signal).", "", _text),
)

FLAG_SETTINGS = tuple(s for s in SETTINGS if s.from_flag is not None)
FIELD_SETTINGS = tuple(s for s in SETTINGS if s.from_field is not None)
