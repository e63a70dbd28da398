"""Policies, a signal and a decode step registered outside the package, in one file: the server imports it
with --kvx-policy-modules."""

import torch

from sglang_kvx.decode import FULL, DecodeStep, register_decode_step
from sglang_kvx.policies import KVPolicy, register_policy
from sglang_kvx.policies.base import layer_signal
from sglang_kvx.signals import CaptureSpec, Signal, register_signal


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


@register_signal
class PeakAttention(Signal):
    """Per KV head and key, the largest causal softmax weight any context query of the head's group
    gave it (a rule not in the package: H2O sums these weights, this keeps their maximum)."""

    name = "_throwaway_peak_attention"
    field = "_throwaway_peak_attention"
    reads_queries = True

    def start(self, n, num_layers, option, setup):
        return {"n": n, "peaks": [None] * num_layers}

    def on_queries(self, state, chunk):
        queries, keys = chunk.queries, chunk.keys.float()  # [t, Hq, D], [S, Hkv, D]
        group = queries.shape[1] // keys.shape[1]
        logits = torch.einsum("thd,shd->hts", queries, keys.repeat_interleave(group, dim=1)) * chunk.scaling
        query_positions = torch.arange(chunk.positions.start, chunk.positions.stop, device=keys.device)
        future = torch.arange(keys.shape[0], device=keys.device)[None, :] > query_positions[:, None]
        peak = logits.masked_fill(future, float("-inf")).softmax(dim=-1).amax(dim=1)  # [Hq, S]
        peak = peak.reshape(keys.shape[1], group, -1).amax(dim=1)
        peaks = state["peaks"]
        if peaks[chunk.layer] is None:
            peaks[chunk.layer] = torch.zeros(keys.shape[1], state["n"], device=keys.device)
        current = peaks[chunk.layer][:, : keys.shape[0]]
        torch.maximum(current, peak, out=current)

    def fill(self, state, signals):
        signals.put(self.field, state["peaks"])

    def reference(self, layer, option):
        q, k = layer.queries, layer.keys  # [Hq, n, D], [Hkv, n, D]: the whole context at once
        group = q.shape[0] // k.shape[0]
        probs = (q @ k.repeat_interleave(group, dim=0).transpose(1, 2) * layer.scaling)
        probs = probs.masked_fill(torch.ones_like(probs[0], dtype=torch.bool).triu(1), float("-inf")).softmax(dim=-1)
        return probs.amax(dim=1).reshape(k.shape[0], group, -1).amax(dim=1)


@register_policy("_throwaway_peak")
class PeakAttentionPolicy(KVPolicy):
    """Keeps the entries some query attended to most: reads the signal above, captured for it by the server."""

    needs = frozenset({"attention"})

    def captures(self):
        return CaptureSpec(_throwaway_peak_attention=True)

    def score(self, signals, layer, budget=None):
        return layer_signal(signals, "_throwaway_peak_attention", layer, self.name).float()
