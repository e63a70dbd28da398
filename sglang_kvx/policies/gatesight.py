"""``gatesight``: predict each entry's future utility from what the GDN layers wrote, no attention scores.

GateSight (seed 000 in ../shared/seeds; method digest). After one prefill of a hybrid model,
per (attention layer, KV head) a one-hidden-layer MLP reads the write gate beta, log-decay g and
write magnitude ||v|| of every value head of up to six preceding GDN layers, plus three
normalised age features, and predicts the entry's utility (trained on leave-one-out changes of
the attention output, ``sglang_kvx.gatesight.labels``). Every estimator runs as one batched op
(``ops.gatesight``). Each head keeps its top-K under its layer's budget.

Budgets: the seed makes each layer's budget proportional to its mean attention output gate (the
``gate`` allocation, selectable per request). Our default is flat budgets: on held-out suite
data the gate budgets starve the demo hybrid's first attention layer, whose gate is mostly shut
over filler but which reads the needles when answering, and a floor of the flat budget under
them only helped as it approached 1 (README, "Evaluation").
"""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_kvx.gatesight.estimator import GateSightEstimator, find_estimator
from sglang_kvx.gatesight.features import (AGE_FEATURES, SIGNALS_PER_HEAD, all_layer_features, chunk_features,
                                           layer_features, layer_groups)
from sglang_kvx.policies.base import KVPolicy, check_layer, register_policy
from sglang_kvx.signals import ChunkScoring, ContextSignals, GDNLayerSignals


FEATURE_BYTES = 256 << 20  # float32 estimator inputs held at once when a whole context is scored
                           # (a 64K context of a Qwen3-Next-sized model is ~150 MiB per attention layer)


@register_policy("gatesight")
class GateSightPolicy(KVPolicy):
    needs = frozenset({"gdn", "output_gate"})
    allocation = "flat"  # the seed's "gate" budgets are the ablation (see the module docstring)
    # Under --tp-size > 1 the runtime gathers every rank's GDN signals and output gates first
    # (signals.gather_heads): each rank scores the whole model's features and keeps its own KV heads.
    # On one rank the server scores each prefill chunk as it runs (``chunk_scoring``): every feature
    # is the token's own, so the context's GDN signals are never held whole.

    def __init__(
        self,
        *,
        estimator: GateSightEstimator | str | Path | None = None,
        model_path: str | Path | None = None,
        impl: str = "auto",
    ) -> None:
        if estimator is None:
            if model_path is None:
                raise ValueError("gatesight needs its trained estimators: pass estimator=DIR or model_path=MODEL")
            estimator = find_estimator(model_path)
        if not isinstance(estimator, GateSightEstimator):
            estimator = GateSightEstimator.load(estimator, model_path=model_path)
        self.estimator = estimator
        self.window = int(estimator.manifest.get("gdn_window", 6))
        self.gdn_heads = (estimator.num_features - AGE_FEATURES) // (SIGNALS_PER_HEAD * self.window)  # value heads read
        self.impl = impl

    @classmethod
    def from_config(cls, config) -> "GateSightPolicy":
        """The server's estimator folder (``--kvx-estimator``), else the one trained for ``--model-path``."""
        return cls(estimator=config.estimator or None, model_path=config.model_path or None)

    def _own_heads(self, signals: ContextSignals) -> slice:
        """The estimators' KV heads this context's keep-set is for (a tensor-parallel rank's own)."""
        start, end = signals.kv_heads or (0, signals.num_kv_heads)
        if (signals.num_layers != self.estimator.num_layers or end - start != signals.num_kv_heads
                or end > self.estimator.num_kv_heads or (signals.kv_heads is None and end != self.estimator.num_kv_heads)):
            raise ValueError(
                f"GateSight estimators cover {self.estimator.num_layers} attention layers x {self.estimator.num_kv_heads} "
                f"KV heads; this model has {signals.num_layers} x {signals.num_kv_heads} (heads {start}-{end - 1})"
            )
        return slice(start, end)

    def chunk_scoring(self) -> ChunkScoring:
        return ChunkScoring(self.window, self.score_chunk)

    def score_chunk(self, layer: int, gdn: list[GDNLayerSignals], positions: range, n: int) -> torch.Tensor:
        """[kv_heads, t]: attention layer ``layer``'s utilities of the context positions ``positions``,
        from their signals of the GDN layers before it (all heads of the model, oldest layer first)."""
        features = chunk_features(gdn, self.window, positions, n, self.gdn_heads)
        return self.estimator.score(features[None], impl=self.impl, layers=slice(layer, layer + 1))[0]

    def score_layers(self, signals: ContextSignals, budgets: list[int] | None = None) -> list[torch.Tensor]:
        """Several layers per batched MLP op, as many as keep their features under FEATURE_BYTES
        (all of a short context's at once; one layer at a time for a long one on a large model);
        or the scores the server computed chunk by chunk inside the prefill."""
        heads = self._own_heads(signals)
        if signals.streamed_scores is not None:
            return [scores[heads] for scores in signals.streamed_scores]
        scores: list[torch.Tensor] = []
        for layers in layer_groups(signals, FEATURE_BYTES, self.window):
            features = all_layer_features(signals, self.window, layers)
            utility = self.estimator.score(features, impl=self.impl, layers=slice(layers.start, layers.stop))
            scores += list(utility[:, heads].unbind(0))
        return scores

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        check_layer(signals, layer)
        heads = self._own_heads(signals)
        if signals.streamed_scores is not None:
            return signals.streamed_scores[layer][heads]
        features = layer_features(signals, layer, self.window)[None]
        return self.estimator.score(features, impl=self.impl, layers=slice(layer, layer + 1))[0, heads]
