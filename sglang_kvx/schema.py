"""Every setting of the extension, declared once: its ``--kvx-*`` flag, its ``custom_params.kvx``
request field, its default, its kind (range, parsing, messages) and its help.

From ``SETTINGS`` come the launcher's flags and their help (``config.add_cli_args``), the server
config's fields (``config.KvxConfig``) and the scheduler's (``settings.ServerDefaults``, the same typed
values plus what the server knows), ``Engine``'s keyword arguments (``adapter/engine.py``), the door's
parsing of a request's fields and its messages (``settings.parse_request_fields``, ``adapter/door.py``)
and the hostile-input battery the tests run against every flag. Adding a setting is one ``Setting``
here and the code that reads it. The checks of a value against the model and the server's other flags
stay where those facts are known (``config.build_config`` at launch, ``settings.resolve_settings`` per
request).

Each setting has one ``Kind``: one parser for a flag's text (the command line, an ``Engine`` keyword)
and a request's JSON alike. Text is first read as the value it spells (``"0.5"`` -> 0.5, ``"on"`` ->
true, a decode step's JSON or name -> its object); JSON is taken as it is (``"0.5"`` is not a number,
``true`` is not 1); then one range check, and one message naming the flag or the field, which never
echoes a large value.
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


# --- kinds of values ----------------------------------------------------------------------------------


class Kind:
    """How one kind of setting is read. ``parse(value, label, text)``: ``text`` (a flag) is first read as
    the JSON value it spells (``from_text``), then both take ``check``; ``label`` names the flag or field."""

    def parse(self, value: Any, label: str, text: bool = False) -> Any:
        return self.check(self.from_text(value, label) if text else value, label)

    def from_text(self, raw: Any, label: str) -> Any:
        return raw

    def check(self, value: Any, label: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Kind):
    """A finite number in [low, high] (``low_open`` / ``high_open`` exclude that end; ``whole``: an
    integer; ``empty``: "" or null mean none)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    whole: bool = False
    unit: str = ""  # said in the message: "a number of GB"
    empty: bool = False

    @property
    def expects(self) -> str:
        if self.whole:
            return f"a whole number in [{self.low:g}, {self.high:g}]" if self.high < MAX_TOKENS else f"a whole number >= {self.low:g}"
        span = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"a{' finite' if not self.unit and self.low < 0 else ''} number{' of ' + self.unit if self.unit else ''} in {span}"

    def from_text(self, raw: Any, label: str) -> Any:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return raw  # an Engine keyword given as a number
        if self.empty and raw in (None, ""):
            return None
        try:
            return int(raw) if self.whole else float(raw)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{label} must be {self.expects}, got {_short(raw)}") from None

    def check(self, value: Any, label: str) -> Any:
        if value is None and self.empty:
            return None
        kinds = int if self.whole else (int, float)
        ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            ok = (self.low < value if self.low_open else self.low <= value) and (
                value < self.high if self.high_open else value <= self.high)
        if not ok:
            raise ValueError(f"{label} must be {self.expects}, got {_short(value)}")
        return value if self.whole else float(value)


@dataclass(frozen=True)
class Switch(Kind):
    """On or off: JSON true / false; on a command line 'on' / 'off', or the flag alone (SGLang's
    store_true booleans), which the launcher passes as 'on'."""

    def from_text(self, raw: Any, label: str) -> Any:
        if isinstance(raw, bool):
            return raw
        if raw not in ("on", "off"):
            raise ValueError(f"{label} must be 'on' or 'off' (or given alone for on), got {_short(raw)}")
        return raw == "on"

    def check(self, value: Any, label: str) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be true or false, got {_short(value)}")
        return value


@dataclass(frozen=True)
class Text(Kind):
    """A string; ``path``: a file system path ("" = none), at most 4096 characters, no NUL."""

    path: bool = False

    def from_text(self, raw: Any, label: str) -> Any:
        return str(raw or "")

    def check(self, value: Any, label: str) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"{label} must be a string, got {_short(value)}")
        if self.path and (len(value) > 4096 or "\0" in value):
            raise ValueError(f"{label} must be a path of at most 4096 characters, got {_short(value)}")
        return value


@dataclass(frozen=True)
class Name(Kind):
    """One of a registry's names (listed in the message)."""

    choices: Callable[[], list[str]]

    def check(self, value: Any, label: str) -> Any:
        valid = self.choices()
        if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or value not in valid:
            raise ValueError(f"{label} must be a string naming one of the valid choices: {', '.join(valid)}, "
                             f"got {_short(value)}")
        return value


@dataclass(frozen=True)
class Tenant(Kind):
    def check(self, value: Any, label: str) -> Any:
        if not isinstance(value, str) or TENANT_PATTERN.fullmatch(value) is None:
            raise ValueError(f"{label} must be a string of 1 to 64 letters, digits or ._:@-, got {_short(value)}")
        return value


@dataclass(frozen=True)
class Decode(Kind):
    """A decode step and its options: JSON ``{"step": ..., ...}``; on a command line that JSON, or the
    step's name alone. The value is the typed ``decode.DecodeSettings`` ("" / null: none)."""

    def from_text(self, raw: Any, label: str) -> Any:
        raw = (raw or "").strip() if isinstance(raw, str) else raw
        if not raw or not isinstance(raw, str):
            return raw or None
        if not raw.startswith("{"):
            return {"step": raw}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{label} is not valid JSON ({exc.msg})") from None

    def check(self, value: Any, label: str) -> Any:
        from sglang_kvx.decode import parse_decode_settings

        return parse_decode_settings(value, field=label)


@dataclass(frozen=True)
class SparseBudget(Number):
    """Block-sparse attention's token budget: 0, or a multiple of the block of at least two blocks."""

    def check(self, value: Any, label: str) -> Any:
        from sglang_kvx.ops.block_layout import BLOCK

        budget = super().check(value, label)
        if budget and (budget % BLOCK or budget < 2 * BLOCK):
            raise ValueError(f"{label} must be 0 or a multiple of {BLOCK} of at least {2 * BLOCK} "
                             f"(the first block and a query's own), got {budget}")
        return budget


FRACTION = Number(0.0, 1.0, low_open=True)
SHARE = Number(0.0, 1.0, high_open=True)
COUNT = Number(0, MAX_TOKENS, whole=True)
GIGABYTES = Number(0.0, float(1 << 20), unit="GB")
PATH = Text(path=True)


@dataclass(frozen=True)
class Setting:
    """One setting: ``flag`` -- a launcher flag ``--kvx-<name>`` (its text ``default``) whose typed value
    is the server config's ``attr``; ``field`` -- a request field ``custom_params.kvx.<name>``."""

    name: str
    help: str
    kind: Kind
    default: str | None = None  # the flag's default, as typed on a command line
    flag_too: bool = True
    field_too: bool = False
    attr: str = ""  # the server config's attribute ("" = name)
    field_kind: Kind | None = None  # the field's own kind, where it is narrower than the flag's

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

    @property
    def is_switch(self) -> bool:
        return isinstance(self.kind, Switch)

    def from_flag(self, raw: Any) -> Any:
        """The flag's typed value from its text (raises ValueError naming the flag)."""
        return self.kind.parse(raw, self.flag, text=True)

    def from_field(self, value: Any) -> Any:
        """The request field's typed value from JSON (None: not sent; raises ValueError naming the field)."""
        return None if value is None else (self.field_kind or self.kind).parse(value, f"{FIELD_PREFIX}.{self.name}")

    def help_text(self) -> str:
        """The help, with any list it names read from its registry now (``{decode_steps}``)."""
        if "{decode_steps}" not in self.help:
            return self.help
        from sglang_kvx.decode import decode_step_names

        return self.help.replace("{decode_steps}", ", ".join(decode_step_names()))


def _policy_names() -> list[str]:
    from sglang_kvx.policies import servable_policy_names

    return servable_policy_names()


def _allocation_names() -> list[str]:
    from sglang_kvx.allocate import allocation_names

    return allocation_names()


# --- the settings -----------------------------------------------------------------------------------

SETTINGS: tuple[Setting, ...] = (
    # The flag is any text here (build_config names the servable choices, and none, when it refuses one); a
    # request names a servable policy.
    Setting("policy", "KV policy applied after a context's prefill ('none' = plain SGLang).", Text(), "none",
            field_too=True, field_kind=Name(_policy_names)),
    Setting("keep_fraction", "Fraction p in (0, 1] of a context's KV entries each compacted context keeps.",
            FRACTION, "1.0", field_too=True),
    Setting("protected_prefix_len", "Leading tokens of every compacted context kept outside the budget "
            "(per request: custom_params.kvx.protected_prefix_len).", COUNT, "0", field_too=True),
    Setting("allocation", "How a context's budget is shared out over layers and KV heads (default: the policy's).",
            Name(_allocation_names), flag_too=False, field_too=True),
    Setting("compact", "false: this parent keeps its full cache (no policy runs on it).", Switch(), flag_too=False,
            field_too=True),
    Setting("decode", "A decode-time step every generating request runs unless it names its own "
            "(custom_params.kvx.decode): a step name ({decode_steps}) "
            "or a JSON object with its options, e.g. '{\"step\": \"oda\", \"window\": 128, \"theta\": 0.5}'. "
            "Implies --kvx-decode-steps.", Decode(), "", field_too=True),
    Setting("tenant", "Whose contexts these are: each tenant's share of the store's reserve is its own.", Tenant(),
            flag_too=False, field_too=True),
    Setting("estimator", "GateSight estimator folder (default: the one trained for --model-path, in "
            "<model>/gatesight or weights/gatesight/).", PATH, ""),
    Setting("min_store_fraction", "Share of the KV pool kept for compacted contexts: the most recently used ones "
            "within it are never evicted to make room.", SHARE, "0.25"),
    Setting("reserved_tenants", "Tenants (custom_params.kvx.tenant) with a share of that reserve of their own, "
            "first come first served (a tenant keeps its seat while it holds a context); every other tenant shares "
            "one more share with untagged requests, so inventing tenant names cannot dilute a seated tenant's share.",
            Number(0, 4096, whole=True), "8"),
    Setting("decode_steps", "Requests may ask for a decode-time step (custom_params.kvx.decode: {decode_steps}).",
            Switch(), "off"),
    Setting("auto_context_min_tokens", "Compact, unasked, the beginning plain requests keep repeating once it is at "
            "least this many tokens (a document asked about without marking it; SGLang's threaded frontend fork); "
            "0 = off (such prefixes are only logged).", COUNT, "0"),
    Setting("oda_head", "On-Demand Attention's recall head folder (default: the one trained for --model-path, in "
            "<model>/oda or weights/oda/<model folder name>).", PATH, ""),
    Setting("kvzap_surrogates", "KVzap's surrogate folder, holding mlp/ and linear/ (default: the ones trained for "
            "--model-path, in <model>/kvzap or weights/kvzap/).", PATH, ""),
    Setting("kvzap_threshold", "KVzap's threshold tau on each entry's predicted log KVzip+ score: entries under it are "
            "dropped (default: the surrogate manifest's).", Number(-1e6, 1e6, empty=True), ""),
    Setting("kvzap_window", "KVzap's window: the last N tokens of a context are always kept (default: 128 under its "
            "threshold rule, none under a budget such as \"allocation\": \"global\", where a window is counted in the "
            "budget).", Number(0, MAX_TOKENS, whole=True, empty=True), ""),
    Setting("sparse_attention", "Block-sparse attention for every request: each query attends to this many tokens "
            "(a multiple of 4, at least 8), in four-token blocks -- the first, its own and the best others by a "
            "mean-key indexer; 0 = dense attention.", SparseBudget(0, MAX_TOKENS, whole=True), "0", attr="sparse_budget"),
    Setting("host_store_gb", "Host memory (GB) for compacted contexts evicted from the KV pool: a child of one is "
            "served by copying its kept entries back instead of a new prefill and compaction; least recently used "
            "first out; 0 = off (an evicted context is dropped).", GIGABYTES, "0"),
    Setting("context_dir", "Directory for compacted contexts on disk: those host memory lets go (or the pool evicts, "
            "without a host tier) are written there as safetensors plus a JSON manifest, and a child of one -- on "
            "this server, after a restart, or on another server of the same model sharing the path -- restores it "
            "instead of a new prefill; \"\" = off.", PATH, ""),
    Setting("disk_store_gb", "Disk space (GB) this model's context files may take in --kvx-context-dir; least "
            "recently used first out.", GIGABYTES, "16"),
    Setting("persist_contexts", "Every compacted context is written to --kvx-context-dir as soon as it is stored, so "
            "it outlives the process (kill -9 included); without it only evicted ones are.", Switch(), "off"),
    Setting("context_secret_file", "A file holding a secret (16+ bytes) shared by the servers on --kvx-context-dir: "
            "every manifest they write carries an HMAC with it, and a file without a valid one is refused (a process "
            "that can write the directory but not read this file cannot make a server serve its bytes).", PATH, ""),
    Setting("policy_modules", "Comma-separated Python modules imported first in every server process: each "
            "registers its own policies (@register_policy), decode steps (@register_decode_step) and signals "
            "(@register_signal).", Text(), ""),
)

FLAG_SETTINGS = tuple(s for s in SETTINGS if s.flag_too)
FIELD_SETTINGS = tuple(s for s in SETTINGS if s.field_too)


def flags_table() -> str:
    """The flags as docs/serving.md lists them (a test holds the page to this)."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for setting in FLAG_SETTINGS:
        form = f"`{setting.flag}`" + (" (alone: on)" if setting.is_switch else "")
        rows.append(f"| {form} | {f'`{setting.default}`' if setting.default else 'none'} | {setting.help_text()} |")
    return "\n".join(rows)
