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

from sglang_kvx.signals import ContextSignals, GDNLayerSignals

GDN_WINDOW = 6  # preceding GDN layers an estimator reads (the paper's six-layer window)
SIGNALS_PER_HEAD = 3  # beta, g, log||v||
AGE_FEATURES = 3
_V_NORM_FLOOR = 1e-6  # log of a zero write stays finite


def num_features(gdn_heads: int, window: int = GDN_WINDOW) -> int:
    return window * gdn_heads * SIGNALS_PER_HEAD + AGE_FEATURES


def age_features(n: int, device: torch.device | str = "cpu", start: int = 0, length: int | None = None) -> torch.Tensor:
    """[length, 3] (default [n, 3]) for context positions [start, start + length) of an n-token context:
    linear and log age from the end, log distance from the start, all in [0, 1]."""
    length = n - start if length is None else length
    position = torch.arange(start, start + length, device=device, dtype=torch.float32)
    age = (n - 1) - position
    log_n = math.log1p(n)
    return torch.stack([age / n, torch.log1p(age) / log_n, torch.log1p(position) / log_n], dim=1)


def _gdn_block(gdn, n: int, heads: int) -> torch.Tensor:
    """[n, Hv * 3]: one GDN layer's (beta, g, log||v||) per value head (n: the tokens it covers)."""
    if gdn.beta.shape != (n, heads):
        raise ValueError(f"GDN signals of shape {tuple(gdn.beta.shape)} for {n} tokens with {heads} heads")
    per_head = torch.stack([gdn.beta.float(), gdn.g.float(), gdn.v_norm.float().clamp_min(_V_NORM_FLOOR).log()], dim=2)
    return per_head.reshape(n, heads * SIGNALS_PER_HEAD)


def _check_gdn(signals: ContextSignals) -> None:
    if not signals.gdn:
        raise ValueError("GateSight needs GDN signals (beta, g, ||v||): this context has none (not a hybrid model?)")


def _fill_layer(out: torch.Tensor, blocks: list[torch.Tensor], before: int, window: int, ages: torch.Tensor) -> None:
    """Write one attention layer's features into ``out`` [n, F]: zero padding for missing GDN layers,
    the last ``window`` GDN blocks before the layer (oldest first), then the ages."""
    chosen = blocks[max(0, before - window) : before]
    width = (out.shape[1] - AGE_FEATURES) // window
    column = (window - len(chosen)) * width
    out[:, :column].zero_()
    for block in chosen:
        out[:, column : column + width] = block
        column += width
    out[:, column:] = ages


def layer_features(signals: ContextSignals, layer: int, window: int = GDN_WINDOW) -> torch.Tensor:
    """[n, F]: the full estimator input of attention layer ``layer``."""
    _check_gdn(signals)
    before = signals.gdn_layer_of_attention[layer]
    return chunk_features(signals.gdn[max(0, before - window) : before], window, range(signals.n), signals.n,
                          signals.gdn[0].beta.shape[1])


def chunk_features(gdn: list[GDNLayerSignals], window: int, positions: range, n: int, heads: int) -> torch.Tensor:
    """[t, F]: an attention layer's estimator input for the context positions ``positions`` (t of
    them, consecutive) of an n-token context, from those positions' signals of the (up to ``window``)
    GDN layers before it, oldest first. Every feature is the token's own, so a prefill chunk can be
    scored as it runs."""
    blocks = [_gdn_block(g, len(positions), heads) for g in gdn[-window:]] if window else []
    device = gdn[0].beta.device if gdn else "cpu"
    out = torch.empty(len(positions), num_features(heads, window), device=device)
    _fill_layer(out, blocks, len(blocks), window, age_features(n, device, positions.start, len(positions)))
    return out


def all_layer_features(signals: ContextSignals, window: int = GDN_WINDOW, layers: range | None = None) -> torch.Tensor:
    """[L', n, F] for the attention layers ``layers`` (default all; one batched scoring op reads
    this); each GDN layer's block is built once, however many of those layers read it."""
    _check_gdn(signals)
    layers = range(signals.num_layers) if layers is None else layers
    heads, n = signals.gdn[0].beta.shape[1], signals.n
    first = min(max(0, signals.gdn_layer_of_attention[layer] - window) for layer in layers)
    last = max(signals.gdn_layer_of_attention[layer] for layer in layers)
    blocks = {i: _gdn_block(signals.gdn[i], n, heads) for i in range(first, last)}
    device = signals.gdn[0].beta.device
    out = torch.empty(len(layers), n, num_features(heads, window), device=device)
    ages = age_features(n, device)
    for row, layer in enumerate(layers):
        before = signals.gdn_layer_of_attention[layer]
        chosen = [blocks[i] for i in range(max(0, before - window), before)]
        _fill_layer(out[row], chosen, len(chosen), window, ages)
    return out


def layer_groups(signals: ContextSignals, byte_cap: int, window: int = GDN_WINDOW) -> list[range]:
    """Consecutive attention layers whose features together stay under ``byte_cap`` bytes (at least
    one layer per group): a long context is scored a few layers at a time, never all at once."""
    _check_gdn(signals)
    per_layer = signals.n * num_features(signals.gdn[0].beta.shape[1], window) * 4  # float32
    size = max(1, byte_cap // max(per_layer, 1))
    return [range(start, min(start + size, signals.num_layers)) for start in range(0, signals.num_layers, size)]
