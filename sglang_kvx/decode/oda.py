"""``oda``: On-Demand Attention (seed 003, section 2) — local-first decoding; a learned recall head
decides when a step needs Full attention.

Every decode step first runs Local attention (the first ``sinks`` keys plus the ``window`` most
recent, the current one included). The server's recall head (``recall_head.py``) scores the step
from the previous committed final hidden state, the current token's embedding and the Local final
hidden state; a score above ``theta`` (0 by default; a score that is not finite counts as above)
re-runs the step with Full attention from the same pre-step state, and only that run is kept
(Eq. 4: r_t = 1[s_t > theta]). Nothing is dropped: what Local skipped stays for later Full steps.
The prefill runs Full; the first routed step consumes the token it produced (the handoff of 2.1).

The step owns its mechanism: it declares the forward's final hidden states and input embeddings as
what it reads (``forward_outputs``: the adapter captures them for its rows, whose batches then run
eagerly), loads the head it scores with (``load_resources``: ``--kvx-oda-head``, else the head trained
for the served model, in ``<model>/oda`` or ``weights/oda/<model folder name>``), and keeps each
request's last committed hidden state in its row state (``RoutedRow``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from sglang_kvx.decode.base import FULL, DecodeStep, Span, StepUnavailable, register_decode_step
from sglang_kvx.decode.row_state import FINAL_HIDDEN, INPUT_EMBEDDINGS, ForwardOutputs, RowState
from sglang_kvx.ops.host_syncs import device_positions, host_values


class RoutedRow(RowState):
    """A request under On-Demand Attention: its last committed final hidden state (the recall head's
    ``prev_h``, seeded by the prefill) and how many of its steps were re-run with Full attention."""

    report = "oda_requests"

    def __init__(self, step, request, facts) -> None:
        super().__init__(step, request, facts)
        self.prev_hidden = None  # torch.Tensor [hidden]
        self.routed = 0
        self.full_steps = 0

    def after_run(self, outputs: ForwardOutputs, index: int) -> None:
        # The kept run (a prefill chunk, or the step's committed branch): its final hidden state is the next prev_h.
        self.prev_hidden = outputs.final_hidden[index].detach().clone()

    @classmethod
    def first_run_scores(cls, states: list[RowState], index: list[int], outputs: ForwardOutputs | None) -> list:
        """The recall head's score of each row's Local attempt, in one batched call (None for a row with no
        prev_h yet: it runs Full)."""
        head = states[0].facts.resources.get(states[0].step.name) if states else None
        scored = [k for k, state in enumerate(states) if state.prev_hidden is not None]
        scores: list = [None] * len(states)
        if head is None or outputs is None or not scored:
            return scores
        local, embeddings = outputs.final_hidden, outputs.input_embeddings
        positions = [index[k] for k in scored]
        if positions != list(range(local.shape[0])):  # some rows of the batch are not scored: gather the others
            at = device_positions(positions, local.device)
            local, embeddings = local.index_select(0, at), embeddings.index_select(0, at)
        prev = torch.stack([states[k].prev_hidden for k in scored]).to(local.device)
        # The step's one read back: the host decides which rows re-run.
        for k, score in zip(scored, host_values(head(prev, embeddings, local).float().cpu())):
            scores[k] = score
        return scores

    def chose(self, span: Span | None) -> None:
        full = span is not None and span.full
        self.routed += 1
        self.full_steps += full
        totals = self.facts.totals
        totals["oda_routed_steps"] += 1
        totals["oda_full_steps"] += full
        totals["oda_full_rate"] = round(totals["oda_full_steps"] / totals["oda_routed_steps"], 6)

    def summary(self, row: int) -> dict:
        return {"decode": self.step.name, "routed_steps": self.routed, "full_steps": self.full_steps,
                "full_rate": round(self.full_steps / self.routed, 6) if self.routed else 0.0}

    def outcome(self, row: int) -> dict:
        """The summary and the FLOPs ledger of the schedule it ran (seed 003, Eqs. 24-25)."""
        from sglang_kvx.decode.flops import oda_flops

        head = self.facts.resources.get(self.step.name)
        ledger = oda_flops(self.facts.model_path, len(self.request.input_ids), self.step.schedule,
                           sinks=self.step.sinks, window=self.step.window, head_flops=head.flops() if head else 0)
        return {**self.summary(row), "flops": {key: ledger[key] for key in ("full_flops", "oda_flops", "saved_fraction")}}


@register_decode_step("oda")
class OnDemandAttention(DecodeStep):
    options = ("sinks", "window")
    real_options = ("theta",)
    forward_outputs = frozenset({FINAL_HIDDEN, INPUT_EMBEDDINGS})
    row_state = RoutedRow

    @classmethod
    def totals(cls, num_layers: int) -> dict:
        return {"oda_routed_steps": 0, "oda_full_steps": 0, "oda_full_rate": 0.0}

    @classmethod
    def load_resources(cls, config: Any, device: torch.device | None = None):
        """The recall head, checked against the served model (``decode.recall_head.RecallHead``)."""
        from sglang_kvx.decode.recall_head import RecallHead

        folder = find_head(config.model_path, config.oda_head)
        if not folder:
            raise StepUnavailable(f"On-Demand Attention needs a recall head trained for {config.model_path or 'this model'}: "
                                  f"none in <model>/oda or weights/oda/; pass --kvx-oda-head or train one "
                                  f"(python -m sglang_kvx.training.train_recall_head)")
        if not config.model_path:
            return None
        try:
            head = RecallHead.from_pretrained(folder, config.model_path)
        except (ValueError, OSError, KeyError) as exc:
            raise ValueError(f"--kvx-oda-head: {exc}") from None
        return head.to(device) if device is not None else head

    def __init__(self, *, sinks: int = 4, window: int = 128, theta: float = 0.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.sinks, self.window, self.theta = sinks, window, theta
        self._local = Span(sinks=sinks, window=window)
        self.schedule: list[bool] = []  # per routed step: whether it ran Full (the FLOPs ledger's input)

    def span(self, step: int) -> Span:
        return self._local

    def may_rerun(self, step: int) -> bool:
        return True

    def rerun_span(self, step: int, first: Span, score: float | None = None) -> Span | None:
        full = score is None or not math.isfinite(score) or score > self.theta
        self.schedule.append(full)
        return FULL if full else None


def _short(value: str) -> str:
    """A path for an error message (schema._short's rule: a long one is named by its length only)."""
    return repr(value) if len(value) <= 32 else f"a string of {len(value)} characters"


def find_head(model_path: str, explicit: str = "") -> str:
    """The recall head folder to serve: ``explicit``, else ``<model>/oda``, else ``weights/oda/<model
    folder name>`` beside this package ("" when none exists). A bad explicit folder raises ValueError."""
    if explicit:
        try:
            found = (Path(explicit) / "manifest.json").is_file()
        except OSError as exc:  # a name the file system refuses (too long)
            raise ValueError(f"--kvx-oda-head {_short(explicit)}: {exc.strerror}") from None
        if not found:
            raise ValueError(f"--kvx-oda-head {_short(explicit)}: no manifest.json there")
        return explicit
    if not model_path:
        return ""
    model = Path(model_path).expanduser()
    weights = Path(__file__).resolve().parents[2] / "weights" / "oda" / model.resolve().name
    for candidate in (model / "oda", weights):
        if (candidate / "manifest.json").exists():
            return str(candidate)
    return ""
