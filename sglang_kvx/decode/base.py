"""Decode-time steps: what a running request's next decode step attends to, what it drops after.

The extension point for methods that act at every decode step (learned-gate eviction drops what
a gate shuts; On-Demand Attention picks each step's span and may re-run it; StreamingLLM keeps
sinks and a window). A step is one short class registered by name, like a policy:

  span(step)                the attention span step ``step`` runs with first (full, or sinks + window)
  rerun_span(step, first, score)
                            after that run: the span to re-run the step with (None: keep the result);
                            the runtime restores the row's recurrent (GDN / conv) state first.
                            ``score`` is what the step's row state scored the first run from the
                            forward's outputs (``RowState.first_run_scores``: On-Demand Attention's
                            recall head), else None
  may_rerun(step)           whether rerun_span can ask (the runtime snapshots state only then)
  dropped(seq_len)          after the step, per attention layer, the interval [start, end) of
                            positions that layer never reads again: masked at once, and their
                            slots freed once no layer keeps them
  forward_outputs           what its row state reads of each forward besides the logits (final
                            hidden states, input embeddings: ``row_state.FORWARD_OUTPUTS``); the
                            adapter captures them for its rows only, and such batches run eagerly
                            where a captured graph would not produce them
  load_resources(config)    its server-wide resources (On-Demand Attention's recall head), built once
                            per scheduler from the server's settings; ``StepUnavailable``: its requests
                            are refused with the reason
  row_state, totals        its per-row state (gates, per-head budgets, hidden states, folds), its
                            counters and report, and the server-wide figures it adds to
                            (``decode/row_state.py``)
  live_tokens(prompt_len)   the most entries a request ever holds (None: unbounded): a bounded
                            request may generate past the pool's size
  gate_threshold()          learned-gate eviction: keys whose gate is below it are deleted (0: none)
  first_keep(keys, attention), victim(keys, keep, attention, position)
                            per-head eviction (row state ``HeadRow``: online H2O, KeyDiff): which prefill
                            entries each KV head keeps, and, once a step's write takes a head past
                            ``budget``, the entry it evicts; ``attention`` is what the head's queries
                            paid each entry so far (steps that ``read_attention``), else None

Steps are numbered from 1: step t feeds the request's t-th output token (the prefill ran the prompt
with full attention and produced the first). Positions count from the prompt's first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from sglang_kvx.decode.row_state import FORWARD_OUTPUTS, RowState

MAX_OPTION = 1 << 24
MAX_REAL_OPTION = 1e6


@dataclass(frozen=True)
class Span:
    """The keys one decode step attends to: all of them (``window`` None), or the first ``sinks``
    plus the ``window`` most recent (the current token included)."""

    sinks: int = 0
    window: int | None = None

    @property
    def full(self) -> bool:
        return self.window is None

    def hidden(self, seq_len: int) -> tuple[int, int]:
        """The positions [start, end) this span does not read at a step with ``seq_len`` keys."""
        if self.full:
            return (0, 0)
        start = min(self.sinks, seq_len)
        return (start, max(start, seq_len - self.window))


FULL = Span()


class DecodeStep:
    name: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()  # the request fields it takes, each a whole number
    real_options: ClassVar[tuple[str, ...]] = ()  # ... and those that are real numbers
    forward_outputs: ClassVar[frozenset[str]] = frozenset()  # what its row state reads of each forward (FORWARD_OUTPUTS)
    drops: ClassVar[bool] = False  # dropped() may return something (not yet served over a compacted prefix)
    needs: ClassVar[frozenset[str]] = frozenset()  # model signals it reads (``ModelTraits.signals``)
    reads_attention: ClassVar[bool] = False  # per-head eviction scored by the attention its queries paid each entry
    reads_attention_inputs: ClassVar[bool] = False  # its row state gets each attention layer's input hidden states
    tp_unsafe: ClassVar[str] = ""  # why it cannot run under --tp-size > 1 ("" = it can)
    model_hint: ClassVar[str] = ""  # what to serve when a model lacks what it ``needs``
    row_state: ClassVar[type[RowState]] = RowState  # its per-row state, counters and report (decode/row_state.py)
    budget: int = 0  # per-head eviction: entries each layer's KV head keeps after every step

    @classmethod
    def child_problem(cls, per_head: bool, allocation: str) -> str | None:
        """Why the step cannot run on a child of a compacted context (``per_head``: its KV heads keep
        different counts, under ``allocation``); None when it can. A child naming the step is refused
        with it; the server's default step is not applied to such a child (full attention)."""
        if cls.drops:
            return f"decode step {cls.name!r} evicts entries, which does not yet apply to a child of a compacted context"
        if per_head:
            return (f"decode step {cls.name!r} does not yet apply to a child of a context compacted with per-head "
                    f"budgets (allocation {allocation!r}); compact the context with allocation 'flat'")
        return None

    @classmethod
    def totals(cls, num_layers: int) -> dict[str, Any]:
        """The server-wide figures its row states add to (``/kvx/stats``), at zero: numbers are also
        counts (``/metrics``), lists are per-layer figures."""
        return {}

    @classmethod
    def load_resources(cls, config: Any, device: torch.device | None = None) -> Any:
        """The step's server-wide resources (a trained head), built once per scheduler from the server's
        settings (``KvxConfig``: its flags and model) on ``device``; None when it needs none. Raises
        ValueError when those settings are wrong (the launch fails), ``StepUnavailable`` when this server
        cannot run the step (its requests are refused with the reason)."""
        return None

    def first_keep(self, keys: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        """Per-head eviction, after the prefill: which of its T entries each head keeps, [H, T] bool
        (keys [H, T, D] as cached; attention [H, T] accumulated over the prefill's queries)."""
        raise NotImplementedError(f"decode step {self.name!r} does not evict per head")

    def victim(self, keys: torch.Tensor, keep: torch.Tensor, attention: torch.Tensor | None,
               position: int) -> torch.Tensor:
        """Per-head eviction, after the step at ``position`` wrote its entry and took the heads past
        the budget: the entry each head evicts, [H] positions (keep [H, position + 1])."""
        raise NotImplementedError(f"decode step {self.name!r} does not evict per head")

    def span(self, step: int) -> Span:
        return FULL

    def may_rerun(self, step: int) -> bool:
        return False

    def rerun_span(self, step: int, first: Span, score: float | None = None) -> Span | None:
        return None

    def gate_threshold(self) -> float:
        """Learned-gate eviction: a decode query skips keys whose gate is below this (0: none)."""
        return 0.0

    def live_tokens(self, prompt_len: int) -> int | None:
        """The most KV entries a request of ``prompt_len`` prompt tokens ever holds under this step,
        however long it generates (None: unbounded; the pool bounds its generation as usual)."""
        return None

    def dropped(self, seq_len: int, num_layers: int) -> list[tuple[int, int]] | None:
        """Per attention layer, positions [start, end) dropped for good after a step with ``seq_len``
        keys (None: nothing dropped). Drops only grow, and start where the previous ones started."""
        return None


class StepUnavailable(Exception):
    """This server cannot run the step (``DecodeStep.load_resources``): its requests are refused with the reason."""


DECODE_STEPS: dict[str, type[DecodeStep]] = {}


def register_decode_step(name: str) -> Callable[[type[DecodeStep]], type[DecodeStep]]:
    def decorator(cls: type[DecodeStep]) -> type[DecodeStep]:
        if name in DECODE_STEPS:
            raise ValueError(f"decode step {name!r} is already registered")
        if unknown := sorted(set(cls.forward_outputs) - set(FORWARD_OUTPUTS)):
            raise ValueError(f"decode step {name!r}: forward_outputs {unknown} are none of {', '.join(FORWARD_OUTPUTS)}")
        cls.name = name
        DECODE_STEPS[name] = cls
        return cls

    return decorator


def decode_step_names() -> list[str]:
    return sorted(DECODE_STEPS)


@dataclass(frozen=True)
class DecodeSettings:
    """A request's ``custom_params.kvx.decode``: the step's name and its whole-number options."""

    step: str
    options: tuple[tuple[str, int | float], ...] = ()

    @property
    def step_class(self) -> type[DecodeStep]:
        """The step's class: its facts (``forward_outputs``, ``drops``, ``needs`` ...) without building one."""
        return DECODE_STEPS[self.step]

    def build(self) -> DecodeStep:
        return self.step_class(**dict(self.options))


class DecodeSettingsError(ValueError):
    """A request's decode settings cannot be served; the message names the field."""


def parse_decode_settings(raw: Any, field: str = "custom_params.kvx.decode") -> DecodeSettings | None:
    """Strictly type-check a request's decode settings (None: no decode step)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DecodeSettingsError(f"{field} must be a JSON object with a \"step\" field")
    step = raw.get("step")
    if not isinstance(step, str) or step not in DECODE_STEPS:
        raise DecodeSettingsError(f"{field}.step must be a string naming one of the valid choices: {', '.join(decode_step_names())}")
    cls = DECODE_STEPS[step]
    unknown = [key for key in raw if key != "step" and key not in cls.options + cls.real_options]
    if unknown:
        shown = unknown[0] if isinstance(unknown[0], str) and len(unknown[0]) <= 64 else "a long key"
        raise DecodeSettingsError(f"{field} has an unknown field {shown!r} for step {step!r}; valid fields: "
                            f"{', '.join(('step',) + cls.options + cls.real_options)}")
    options = []
    for key in cls.options:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OPTION:
                raise DecodeSettingsError(f"{field}.{key} must be a whole number in [0, {MAX_OPTION}]")
            options.append((key, value))
    for key in cls.real_options:
        if key in raw:
            value = raw[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or abs(value) > MAX_REAL_OPTION):
                raise DecodeSettingsError(f"{field}.{key} must be a finite number in [-{MAX_REAL_OPTION:g}, {MAX_REAL_OPTION:g}]")
            options.append((key, float(value)))
    settings = DecodeSettings(step, tuple(options))
    try:
        settings.build()
    except ValueError as exc:
        raise DecodeSettingsError(f"{field}: {exc}") from None
    return settings
