"""The checks of a policy, an allocation and a decode step against the server and the model.

One function per kind of setting, used at launch (``config.build_config``: the flags, the facts of
the launch command and the model's local config) and per request (``settings.resolve_settings`` /
``resolve_decode``: a request's fields, the running server's facts). Each returns what is wrong as
one sentence that starts with the caller's name for the setting (``--kvx-policy snapkv`` at
launch, ``policy 'snapkv'`` per request), or None; the caller raises its own error with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvx.allocate import allocation_needs, allocation_reads_scores, allocation_tp_problem
from sglang_kvx.decode import DECODE_STEPS
from sglang_kvx.policies import get_policy


@dataclass(frozen=True)
class ServingFacts:
    """What the server and its model can do, as the checks need them."""

    tp_size: int = 1
    page_size: int = 1
    sparse_budget: int = 0  # --kvx-sparse-attention (0: dense attention)
    model_signals: frozenset[str] | None = None  # None: unknown (a launch whose model config is not local)
    model_name: str = "this model"  # in messages: the architecture at launch
    per_layer_lengths: bool = True  # False on MLA backends: flat budgets only


def policy_problem(policy: str, allocation: str, facts: ServingFacts, *, label: str, allocation_label: str) -> str | None:
    """Why ``policy`` under ``allocation`` cannot be served here (None: it can)."""
    policy_cls = get_policy(policy)
    if facts.tp_size > 1 and policy_cls.tp_unsafe:
        return f"{label} is not supported with --tp-size {facts.tp_size} yet: {policy_cls.tp_unsafe}"
    if facts.page_size > 1 and policy_cls.second_pass:
        return (f"{label} is not supported with --page-size {facts.page_size} yet: its reconstruction passes hold "
                f"the context in slots that are not whole pages")
    if not policy_cls.compacts:
        return None
    if facts.tp_size > 1 and (problem := allocation_tp_problem(allocation)):
        return f"{allocation_label} is not supported with --tp-size {facts.tp_size} yet: {problem}"
    if facts.model_signals is not None:
        missing = sorted(policy_cls.needs - facts.model_signals)
        which = label
        if not missing:
            missing, which = sorted(allocation_needs(allocation) - facts.model_signals), allocation_label
        if missing:
            return f"{which} needs {', '.join(missing)}, which {facts.model_name} does not provide"
    if allocation_reads_scores(allocation):
        for refused, why in ((facts.sparse_budget, "--kvx-sparse-attention regroups a layer's kept entries in blocks"),
                             (facts.page_size > 1, f"--page-size {facts.page_size} pages cannot hold per-head counts")):
            if refused:
                return (f"{allocation_label} budgets each KV head, which this server cannot serve yet: {why}; "
                        f"use allocation 'flat'")
    if allocation != "flat" and not facts.per_layer_lengths:
        return (f"{allocation_label} needs per-layer lengths, which this attention backend (MLA) cannot take; "
                f"use allocation 'flat'")
    return None


def decode_problem(step: str | None, facts: ServingFacts, *, label: str, step_label: str = "") -> str | None:
    """Why the decode step ``step`` (None: any, as a server's ``--kvx-decode-steps`` allows) cannot run here."""
    if facts.sparse_budget:
        return (f"{label}: decode-time steps cannot run under --kvx-sparse-attention yet (block-sparse attention "
                f"reads the whole row, slots a step evicted included)")
    if facts.page_size > 1:
        return (f"{label}: decode-time steps are not supported with --page-size {facts.page_size} yet (they free and "
                f"hold slots one at a time); serve with --page-size 1")
    if step is None:
        return None
    step_cls = DECODE_STEPS[step]
    if facts.tp_size > 1 and step_cls.tp_unsafe:
        return f"{step_label or label} is not supported with --tp-size {facts.tp_size} yet: {step_cls.tp_unsafe}"
    if facts.model_signals is None:
        return None
    missing = sorted(step_cls.needs - facts.model_signals)
    if missing:
        return (f"{step_label or label} needs {', '.join(missing)}, which {facts.model_name} does not provide "
                f"(serve {step_cls.model_hint or 'a model that does'})")
    return None


def with_checkpoint_tau(step: str, options: dict, gate_tau: float | None) -> dict | None:
    """A step taking a threshold gets the checkpoint's frozen one when it names none; None: it
    names none and the checkpoint has none (the caller says how to give one)."""
    if "tau" not in DECODE_STEPS[step].real_options or "tau" in options:
        return options
    return None if gate_tau is None else {**options, "tau": gate_tau}
