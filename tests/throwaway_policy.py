"""Policies and a decode step registered outside the package, in one file: the server imports it with --kvx-policy-modules."""

import torch

from sglang_kvx.decode import FULL, DecodeStep, register_decode_step
from sglang_kvx.policies import KVPolicy, register_policy


@register_policy("_throwaway_even")
class EvenPositions(KVPolicy):
    """Keeps the even positions: a rule simple enough to write the expected keep-set by hand."""

    needs = frozenset()

    def score(self, signals, layer, budget=None):
        positions = torch.arange(signals.n, device=signals.score_device)
        return (-(positions % 2)).float().expand(signals.num_kv_heads, -1)


@register_policy("_throwaway_rank_local")
class RankLocal(KVPolicy):
    """Declares itself not rank-consistent: the server must refuse it under --tp-size > 1."""

    needs = frozenset()
    tp_unsafe = "planted: its scores would differ between ranks"

    def score(self, signals, layer, budget=None):
        return torch.zeros(signals.num_kv_heads, signals.n, device=signals.score_device)


@register_policy("_throwaway_failing")
class FailingPolicy(KVPolicy):
    """Raises while scoring: the server must contain it to this one context and go on."""

    needs = frozenset()

    def score(self, signals, layer, budget=None):
        raise RuntimeError("planted failure in a policy")


@register_policy("_throwaway_failing_capture")
class FailingCapture(KVPolicy):
    """Raises while the server plans what to record for it: contained to that one request."""

    needs = frozenset()

    def captures(self):
        raise RuntimeError("planted failure while planning captures")

    def score(self, signals, layer, budget=None):
        return torch.zeros(signals.num_kv_heads, signals.n)


@register_decode_step("_throwaway_failing_step")
class FailingStep(DecodeStep):
    """Raises at its third decode step: contained to that one request."""

    def span(self, step):
        if step == 3:
            raise RuntimeError("planted failure in a decode step")
        return FULL
