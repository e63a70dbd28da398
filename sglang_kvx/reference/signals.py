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

from sglang_kvx.signals.query_statistics import query_statistics
from sglang_kvx.reference.hf import HFReference
from sglang_kvx.signals import ContextSignals, GDNLayerSignals, QueryStatistics

CAPTURE_ATTENTION = "kvx_signal_capture"
_QUERY_BLOCK = 256


class _Capture:
    """What one forward records. ``lengths``: each batch row's real length (rows are right-padded to
    the longest); ``windows``: how many last queries of each row to keep. Every per-layer list holds
    the rows of a layer one after another (layer-major), so row b of layer l is entry l * B + b."""

    def __init__(self, lengths: list[int], windows: list[int], column_sums: bool, inv_freq: torch.Tensor | None = None) -> None:
        self.lengths = lengths
        self.windows = windows
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


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, col_sums: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of one row, float32 [Hq, n, D] (k, v already repeated to Hq), one query block at a time."""
    n = q.shape[1]
    out = torch.empty_like(q)
    positions = torch.arange(n, device=q.device)
    for start in range(0, n, _QUERY_BLOCK):
        end = min(start + _QUERY_BLOCK, n)
        logits = q[:, start:end] @ k.transpose(1, 2) * scaling
        future = positions[None, :] > positions[start:end, None]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[:, start:end] = probs @ v
        if col_sums is not None:
            col_sums += probs.sum(dim=1)
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
        k = key[row, :, :n].float().repeat_interleave(group, dim=0)
        v = value[row, :, :n].float().repeat_interleave(group, dim=0)
        col_sums = torch.zeros(q.shape[0], n, device=q.device) if capture is not None and capture.column_sums else None
        out[row, :, :n] = _row_attention(q, k, v, scaling, col_sums)
        if capture is None:
            continue
        capture.keys.append(key[row, :, :n].float().clone())
        capture.values.append(value[row, :, :n].float().clone())
        capture.window_queries.append(q[:, max(0, n - capture.windows[row]):].clone())
        if col_sums is not None:
            capture.attention_column_sums.append(col_sums)
        if capture.inv_freq is not None:
            capture.query_statistics.append(query_statistics(q, torch.arange(n, device=q.device), capture.inv_freq.to(q.device)))
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
) -> ContextSignals:
    """Prefill ``context_ids`` once in HF and return everything a policy may read."""
    return batch_context_signals(ref, [context_ids], windows=[window], protected_prefix_len=protected_prefix_len,
                                 column_sums=column_sums, queries=queries)[0]


@torch.no_grad()
def batch_context_signals(
    ref: HFReference,
    sequences: list[list[int]],
    *,
    windows: list[int],
    protected_prefix_len: int = 0,
    column_sums: bool = True,
    queries: bool = True,
) -> list[ContextSignals]:
    """``context_signals`` of several sequences in one forward (right-padded to the longest), one
    ContextSignals per sequence, on the model's device; ``windows[i]``: window queries kept for sequence i.

    Padding is exact for the real tokens: every layer of these models (attention, GDN's causal
    conv and chunked delta rule, norms, MLPs) is causal or per-token, so no real token reads a pad."""
    global _active
    from transformers import AttentionInterface

    model, config = ref.model, ref.model.config
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in sequences]
    batch = len(sequences)
    AttentionInterface.register(CAPTURE_ATTENTION, _capturing_attention)
    capture = _Capture(lengths=lengths, windows=list(windows), column_sums=column_sums,
                       inv_freq=rope_inv_freq(model) if queries else None)
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

    keys, values, window_queries = rows(capture.keys, []), rows(capture.values, []), rows(capture.window_queries, [])
    col_sums, gates, stats, gdn = (rows(capture.attention_column_sums), rows(capture.gates),
                                   rows(capture.query_statistics), rows(capture.gdn, []))
    return [
        ContextSignals(
            n=lengths[row],
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            keys=keys[row],
            values=values[row],
            window_queries=window_queries[row],
            attention_column_sums=col_sums[row] if column_sums else None,
            output_gate=gates[row],
            query_statistics=stats[row],
            gdn=gdn[row],
            gdn_layer_of_attention=gdn_before,
            protected_prefix_len=protected_prefix_len,
            rope_theta=_rope_theta(config),
        )
        for row in range(batch)
    ]


def rope_inv_freq(model) -> torch.Tensor:
    """The RoPE frequencies the model rotates its queries and keys with: [rotary_dim / 2]."""
    return model.model.rotary_emb.inv_freq.detach().float().cpu()


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if theta is not None and math.isfinite(float(theta)) else None
