"""GateSight's estimator inputs: what the GDN layers decided about each token, plus its age.

For attention layer l and context position j the feature vector is
    [ beta, g, log||v|| ] of every value head of the last ``window`` GDN layers before l
    (oldest first; a layer with fewer GDN layers before it is zero-padded at the front)
  + [ age / n, log1p(age) / log1p(n), log1p(j) / log1p(n) ]   with age = n - 1 - j.
beta is the write gate, g the log-decay (<= 0), ||v|| the written value's norm: the native
signals of the one prefill (seed 000, section 4.1: six GDN layers, three age features).
"""

from __future__ import annotations

import math

import torch

from sglang_kvx.signals import ContextSignals

GDN_WINDOW = 6  # preceding GDN layers an estimator reads (the paper's six-layer window)
SIGNALS_PER_HEAD = 3  # beta, g, log||v||
AGE_FEATURES = 3
_V_NORM_FLOOR = 1e-6  # log of a zero write stays finite


def num_features(gdn_heads: int, window: int = GDN_WINDOW) -> int:
    return window * gdn_heads * SIGNALS_PER_HEAD + AGE_FEATURES


def age_features(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, 3]: linear and log age from the end, log distance from the start, all in [0, 1]."""
    position = torch.arange(n, device=device, dtype=torch.float32)
    age = (n - 1) - position
    log_n = math.log1p(n)
    return torch.stack([age / n, torch.log1p(age) / log_n, torch.log1p(position) / log_n], dim=1)


def gdn_features(signals: ContextSignals, layer: int, window: int = GDN_WINDOW) -> torch.Tensor:
    """[n, window * Hv * 3] GDN signals read by attention layer ``layer``'s estimators."""
    if not signals.gdn:
        raise ValueError("GateSight needs GDN signals (beta, g, ||v||): this context has none (not a hybrid model?)")
    before = signals.gdn_layer_of_attention[layer]
    chosen = signals.gdn[max(0, before - window) : before]
    heads = signals.gdn[0].beta.shape[1]
    n = signals.n
    device = signals.gdn[0].beta.device
    columns = [torch.zeros(n, (window - len(chosen)) * heads * SIGNALS_PER_HEAD, device=device)]
    for gdn in chosen:
        if gdn.beta.shape != (n, heads):
            raise ValueError(f"GDN signals of shape {tuple(gdn.beta.shape)} for a {n}-token context with {heads} heads")
        per_head = torch.stack([gdn.beta.float(), gdn.g.float(), gdn.v_norm.float().clamp_min(_V_NORM_FLOOR).log()], dim=2)
        columns.append(per_head.reshape(n, heads * SIGNALS_PER_HEAD))
    return torch.cat(columns, dim=1)


def layer_features(signals: ContextSignals, layer: int, window: int = GDN_WINDOW) -> torch.Tensor:
    """[n, F]: the full estimator input of attention layer ``layer``."""
    return torch.cat([gdn_features(signals, layer, window), age_features(signals.n, signals.gdn[0].beta.device)], dim=1)


def all_layer_features(signals: ContextSignals, window: int = GDN_WINDOW) -> torch.Tensor:
    """[L, n, F] for every attention layer (one batched scoring op reads this)."""
    return torch.stack([layer_features(signals, layer, window) for layer in range(signals.num_layers)])
