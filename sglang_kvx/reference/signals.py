"""ContextSignals from one HF-transformers prefill: the offline producer.

The served producer lives in SGLang's forward; this one runs the same weights in
transformers, so policies can be scored and evaluated (with the compaction
oracle) without a server. One forward pass, nothing recomputed:

- keys / values / window queries: a capturing attention function (registered in
  transformers' AttentionInterface) sees each attention layer's post-RoPE q, k, v;
- attention column sums (H2O): computed there, one query block at a time;
- query statistics (TriAttention): there too, from all context queries un-rotated with their positions;
- output gate (Qwen3.5 / Qwen3-Next): a forward hook on each attention q_proj;
- GDN beta, g, ||v||: the module-level chunked delta rule is wrapped for the pass.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from sglang_kvx.policies.triattention import query_statistics
from sglang_kvx.reference.hf import HFReference
from sglang_kvx.signals import ContextSignals, GDNLayerSignals, QueryStatistics

CAPTURE_ATTENTION = "kvx_signal_capture"
_QUERY_BLOCK = 256


class _Capture:
    def __init__(self, window: int, column_sums: bool, inv_freq: torch.Tensor | None = None) -> None:
        self.window = window
        self.column_sums = column_sums
        self.inv_freq = inv_freq  # RoPE frequencies: record query statistics when set
        self.query_statistics: list[QueryStatistics] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.window_queries: list[torch.Tensor] = []
        self.attention_column_sums: list[torch.Tensor] = []
        self.gates: list[torch.Tensor] = []
        self.gdn: list[GDNLayerSignals] = []


_active: _Capture | None = None


def _capturing_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal eager attention for one sequence that also records what the policies read."""
    capture = _active
    group = query.shape[1] // key.shape[1]
    q = query[0].float()  # [Hq, n, D]
    k = key[0].float().repeat_interleave(group, dim=0)
    v = value[0].float().repeat_interleave(group, dim=0)
    n = q.shape[1]
    out = torch.empty_like(q)
    col_sums = torch.zeros(q.shape[0], n) if capture is not None and capture.column_sums else None
    for start in range(0, n, _QUERY_BLOCK):
        end = min(start + _QUERY_BLOCK, n)
        logits = q[:, start:end] @ k.transpose(1, 2) * scaling
        future = torch.arange(n)[None, :] > torch.arange(start, end)[:, None]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[:, start:end] = probs @ v
        if col_sums is not None:
            col_sums += probs.sum(dim=1)
    if capture is not None:
        capture.keys.append(key[0].float().clone())
        capture.values.append(value[0].float().clone())
        capture.window_queries.append(q[:, max(0, n - capture.window):].clone())
        if col_sums is not None:
            capture.attention_column_sums.append(col_sums)
        if capture.inv_freq is not None:
            capture.query_statistics.append(query_statistics(q, torch.arange(n), capture.inv_freq))
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


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
            capture.gdn.append(
                GDNLayerSignals(beta=beta[0].float().clone(), g=g[0].float().clone(), v_norm=value[0].float().norm(dim=-1))
            )
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
) -> ContextSignals:
    """Prefill ``context_ids`` once in HF and return everything a policy may read."""
    global _active
    from transformers import AttentionInterface

    model, config = ref.model, ref.model.config
    AttentionInterface.register(CAPTURE_ATTENTION, _capturing_attention)
    capture = _Capture(window=window, column_sums=column_sums, inv_freq=rope_inv_freq(model) if queries else None)
    hooks = []
    layers = model.model.layers
    attention_ids = ref.attention_layer_ids
    gated = hasattr(layers[attention_ids[0]].self_attn, "q_proj") and (
        layers[attention_ids[0]].self_attn.q_proj.out_features == 2 * config.num_attention_heads * config.head_dim
    )
    if gated:
        head_dim = config.head_dim

        def record_gate(_module, _inputs, output):
            gate = output[0].view(output.shape[1], -1, 2 * head_dim)[..., head_dim:]
            capture.gates.append(torch.sigmoid(gate.float()).mean(dim=-1))  # [n, Hq]

        hooks = [layers[i].self_attn.q_proj.register_forward_hook(record_gate) for i in attention_ids]
    previous = config._attn_implementation
    model.set_attn_implementation(CAPTURE_ATTENTION)
    _active = capture
    try:
        with _gdn_capture(capture):
            model(torch.tensor([context_ids]), use_cache=False)
    finally:
        _active = None
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()

    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    gdn_before = [sum(t == "linear_attention" for t in layer_types[:i]) for i in attention_ids]
    return ContextSignals(
        n=len(context_ids),
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        keys=capture.keys,
        values=capture.values,
        window_queries=capture.window_queries,
        attention_column_sums=capture.attention_column_sums if column_sums else None,
        output_gate=capture.gates or None,
        query_statistics=capture.query_statistics or None,
        gdn=capture.gdn,
        gdn_layer_of_attention=gdn_before,
        protected_prefix_len=protected_prefix_len,
        rope_theta=_rope_theta(config),
    )


def rope_inv_freq(model) -> torch.Tensor:
    """The RoPE frequencies the model rotates its queries and keys with: [rotary_dim / 2]."""
    return model.model.rotary_emb.inv_freq.detach().float().cpu()


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if theta is not None and math.isfinite(float(theta)) else None
