"""Each attention layer's input hidden states, for the signals and decode steps that read them.

SGLang's decoder layers call their attention module as ``self_attn(positions=..., hidden_states=...,
forward_batch=...)`` with the input norm already applied; no hook target sees that tensor together
with the batch for every model class, so a torch forward pre-hook is put on each attention module
(the module holding a ``RadixAttention`` as ``attn``) at scheduler start. It hands the tensor on only
when a recording (``SignalRecorder.wants_attention_inputs``) or a running decode step
(``serve.decoding.wants_attention_inputs``) reads it; otherwise it returns after two attribute reads.

On a captured graph's replay no Python runs, so nothing is handed over: the signal then finds the
chunk missing and fails that compaction by name, and a decode step fails its request (a batch that
needs these must run eagerly: graph eligibility has to decline it).
"""

from __future__ import annotations

import logging

import torch

from sglang_kvx.adapter.forward import link_of
from sglang_kvx.serve.decoding import hand_attention_inputs, wants_attention_inputs

logger = logging.getLogger(__name__)


def tap_attention_inputs(model) -> int:
    """Put the pre-hook on every attention module of ``model``; returns how many."""
    from sglang.srt.layers.radix_attention import RadixAttention

    count = 0
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, RadixAttention) and not getattr(module, "_kvx_input_tap", False):
            module.register_forward_pre_hook(_before_attention, with_kwargs=True)
            object.__setattr__(module, "_kvx_input_tap", True)
            count += 1
    return count


def _before_attention(module, args, kwargs):
    link = link_of(module.attn)
    if link is None:
        return None
    runtime = link.runtime
    recording = runtime.recorder.wants_attention_inputs
    decoding = bool(runtime.decode) and wants_attention_inputs(runtime.decode)
    if not (recording or decoding):
        return None
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    forward_batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
    if not isinstance(hidden, torch.Tensor) or forward_batch is None:
        return None  # an unknown calling convention: what reads it reports the missing layer
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # graphs are captured on dummy rows
    index = runtime.compactor.layer_index.get(module.attn.layer_id)
    if index is None:
        return None
    batch = link.batch(forward_batch)
    if recording and batch.is_extend:
        runtime.recorder.attention_input(index, hidden, batch)
    if decoding:
        hand_attention_inputs(runtime.decode, index, hidden, batch)
    return None
