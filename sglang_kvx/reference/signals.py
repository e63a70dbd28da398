"""ContextSignals from one HF-transformers prefill: the offline producer.

The served producer lives in SGLang's forward; this one runs the same weights in
transformers, so policies can be scored and evaluated (with the compaction
oracle) without a server. One forward pass, nothing recomputed:

- keys / values: a capturing attention function (registered in
  transformers' AttentionInterface) sees each attention layer's post-RoPE q, k, v;
- every query-reading signal asked for (SnapKV's window, H2O's column sums, TriAttention's query
  statistics, a signal registered elsewhere): its own ``Signal.reference`` from the layer's whole q and k;
- output gate (Qwen3.5 / Qwen3-Next): a forward hook on each attention q_proj;
- attention layers' input hidden states (KVzap, when the spec names ``hidden_states``): a forward
  pre-hook on each attention module;
- GDN beta, g, ||v||: the module-level chunked delta rule is wrapped for the pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Iterator

import torch

from sglang_kvx.reference.hf import HFReference
from sglang_kvx.signals import CaptureSpec, ContextSignals, GDNLayerSignals, ReferenceLayer, get_signal

CAPTURE_ATTENTION = "kvx_signal_capture"
_QUERY_BLOCK = 256


class _Capture:
    """What one forward records. ``lengths``: each batch row's real length (rows are right-padded to
    the longest); ``specs``: what to produce for each row (each query-reading signal's ``reference``).
    Every per-layer list holds the rows of a layer one after another (layer-major), so row b of
    layer l is entry l * B + b."""

    def __init__(self, lengths: list[int], specs: list[CaptureSpec], inv_freq: Callable[[], torch.Tensor]) -> None:
        self.lengths = lengths
        self.specs = specs
        self.inv_freq = inv_freq
        names = sorted({name for spec in specs for name in spec if get_signal(name).reads_queries})
        self.produced: dict[str, list] = {name: [] for name in names}  # signal -> layer-major values (None: row did not ask)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.gates: list[torch.Tensor] = []
        self.gdn: list[GDNLayerSignals] = []
        self.inputs: list[torch.Tensor] = []  # attention layers' input hidden states (layer-major)


_active: _Capture | None = None


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of one row, float32 [Hq, n, D] (k, v already repeated to Hq), one query block at a time."""
    n = q.shape[1]
    out = torch.empty_like(q)
    positions = torch.arange(n, device=q.device)
    for start in range(0, n, _QUERY_BLOCK):
        end = min(start + _QUERY_BLOCK, n)
        logits = q[:, start:end] @ k.transpose(1, 2) * scaling
        future = positions[None, :] > positions[start:end, None]
        out[:, start:end] = logits.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
    return out


def _capturing_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal eager attention, row by row, that also records what the policies read.

    A right-padded row attends over its real tokens only; its padding positions get zeros (causal:
    no real token ever reads them, so they need no meaningful value)."""
    capture = _active
    group = query.shape[1] // key.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)  # [B, Hq, S, D]
    lengths = capture.lengths if capture is not None else [query.shape[2]] * query.shape[0]
    for row, n in enumerate(lengths):
        q = query[row, :, :n].float()  # [Hq, n, D]
        k = key[row, :, :n].float()
        v = value[row, :, :n].float()
        out[row, :, :n] = _row_attention(q, k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0), scaling)
        if capture is None:
            continue
        capture.keys.append(k.clone())
        capture.values.append(v.clone())
        layer = ReferenceLayer(queries=q, keys=k, scaling=scaling, inv_freq=capture.inv_freq)
        spec = capture.specs[row]
        for name, produced in capture.produced.items():
            produced.append(get_signal(name).reference(layer, spec.get(name)) if name in spec else None)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _gdn_capture(capture: _Capture) -> Iterator[None]:
    """Wrap transformers' chunked delta rule (Qwen3.5's and Qwen3-Next's modules) so each GDN
    layer's beta, g and v are recorded."""
    import importlib

    modules = []
    for name in ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_next.modeling_qwen3_next"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:  # no such architecture in this transformers
            continue
    originals = [module.torch_chunk_gated_delta_rule for module in modules]

    def recording_with(original):
        def recording(query, key, value, g, beta, **kwargs):
            for row, n in enumerate(capture.lengths):
                capture.gdn.append(GDNLayerSignals(beta=beta[row, :n].float().clone(), g=g[row, :n].float().clone(),
                                                   v_norm=value[row, :n].float().norm(dim=-1)))
            return original(query, key, value, g=g, beta=beta, **kwargs)

        return recording

    for module, original in zip(modules, originals):
        module.torch_chunk_gated_delta_rule = recording_with(original)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.torch_chunk_gated_delta_rule = original


@torch.no_grad()
def context_signals(
    ref: HFReference,
    context_ids: list[int],
    *,
    window: int = 64,
    protected_prefix_len: int = 0,
    column_sums: bool = True,
    queries: bool = True,
    signals: CaptureSpec | None = None,
) -> ContextSignals:
    """Prefill ``context_ids`` once in HF and return everything a policy may read."""
    return batch_context_signals(ref, [context_ids], windows=[window], protected_prefix_len=protected_prefix_len,
                                 column_sums=column_sums, queries=queries, signals=signals)[0]


@torch.no_grad()
def batch_context_signals(
    ref: HFReference,
    sequences: list[list[int]],
    *,
    windows: list[int],
    protected_prefix_len: int = 0,
    column_sums: bool = True,
    queries: bool = True,
    signals: CaptureSpec | None = None,
) -> list[ContextSignals]:
    """``context_signals`` of several sequences in one forward (right-padded to the longest), one
    ContextSignals per sequence, on the model's device; ``windows[i]``: window queries kept for sequence i.
    The query-reading signals produced: SnapKV's window, H2O's column sums (``column_sums``),
    TriAttention's statistics (``queries``), and any other registered signal ``signals`` names (each
    by its ``Signal.reference``). Output gates and GDN signals are tapped whenever the model has them.

    Padding is exact for the real tokens: every layer of these models (attention, GDN's causal
    conv and chunked delta rule, norms, MLPs) is causal or per-token, so no real token reads a pad."""
    global _active
    from transformers import AttentionInterface

    model, config = ref.model, ref.model.config
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in sequences]
    batch = len(sequences)
    AttentionInterface.register(CAPTURE_ATTENTION, _capturing_attention)
    extra = signals if signals is not None else CaptureSpec()
    specs = [CaptureSpec(window=w, column_sums=column_sums, query_statistics=queries) | extra for w in windows]
    capture = _Capture(lengths=lengths, specs=specs, inv_freq=functools.cache(lambda: rope_inv_freq(model)))
    hooks = []
    layers = model.model.layers
    attention_ids = ref.attention_layer_ids
    gated = hasattr(layers[attention_ids[0]].self_attn, "q_proj") and (
        layers[attention_ids[0]].self_attn.q_proj.out_features == 2 * config.num_attention_heads * config.head_dim
    )
    if gated:
        head_dim = config.head_dim

        def record_gate(_module, _inputs, output):
            for row, n in enumerate(lengths):
                gate = output[row, :n].view(n, -1, 2 * head_dim)[..., head_dim:]
                capture.gates.append(torch.sigmoid(gate.float()).mean(dim=-1))  # [n, Hq]

        hooks = [layers[i].self_attn.q_proj.register_forward_hook(record_gate) for i in attention_ids]
    if any("hidden_states" in spec for spec in specs):  # KVzap's: each attention layer's input, per row [n, hidden]
        def record_input(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            for row, n in enumerate(lengths):
                capture.inputs.append(hidden[row, :n].float().clone())

        hooks += [layers[i].self_attn.register_forward_pre_hook(record_input, with_kwargs=True) for i in attention_ids]
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    ids = torch.full((batch, max(lengths)), pad, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    previous = config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    _active = capture
    try:
        with _gdn_capture(capture):
            model(ids.to(device), use_cache=False)
    finally:
        _active = None
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()

    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    gdn_before = [sum(t == "linear_attention" for t in layer_types[:i]) for i in attention_ids]
    def rows(entries: list, empty: list | None = None) -> list:
        """Layer-major captures -> one list per sequence (``empty`` when nothing was captured)."""
        return [entries[row::batch] for row in range(batch)] if entries else [empty] * batch

    keys, values = rows(capture.keys, []), rows(capture.values, [])
    gates, gdn = rows(capture.gates), rows(capture.gdn, [])
    inputs = rows(capture.inputs)
    produced = {name: rows(values_) for name, values_ in capture.produced.items()}
    results = []
    for row in range(batch):
        result = ContextSignals(
            n=lengths[row],
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            keys=keys[row],
            values=values[row],
            output_gate=gates[row],
            gdn=gdn[row],
            gdn_layer_of_attention=gdn_before,
            protected_prefix_len=protected_prefix_len,
            rope_theta=_rope_theta(config),
        )
        for name, per_row in produced.items():
            if name in specs[row]:
                result.put(get_signal(name).field, per_row[row])
        if "hidden_states" in specs[row]:
            result.put(get_signal("hidden_states").field, inputs[row])
        results.append(result)
    return results


def rope_inv_freq(model) -> torch.Tensor:
    """The RoPE frequencies the model rotates its queries and keys with: [rotary_dim / 2]."""
    return model.model.rotary_emb.inv_freq.detach().float().cpu()


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if theta is not None and math.isfinite(float(theta)) else None
