"""Each attention layer's input hidden states, for the signals and decode steps that read them.

What an attention layer's q/k/v read is the input of its ``qkv_proj`` (after the layer's input norm,
whichever module applies it: Llama's decoder layer before calling its attention module, Qwen3.5's
attention decoder layer inside its own forward). No hook target sees that tensor together with the
forward batch for every model class, so two torch forward pre-hooks are put at scheduler start on
every module holding a ``RadixAttention`` as ``attn`` and a ``qkv_proj``: one on ``qkv_proj`` keeps
its input on the ``attn`` module, the one on ``attn`` (called with the batch) hands it on. They act
only when a recording (``SignalRecorder.wants_attention_inputs``) or a running decode step
(``serve.decoding.wants_attention_inputs``) reads the states; otherwise each returns after two
attribute reads.

On a captured graph's replay no Python runs, so nothing is handed over: graph eligibility declines
every batch that needs these (a recording parent; a decode step that ``reads_attention_inputs``:
``serve/graph_eligibility.py``), and a recording that missed them anyway fails that compaction by name.
"""

from __future__ import annotations

import torch

from sglang_kvx.adapter.forward import link_of
from sglang_kvx.serve.decoding import hand_attention_inputs, wants_attention_inputs

PENDING = "_kvx_attention_input"  # on the RadixAttention module: its qkv_proj's input, until attn runs


def tap_attention_inputs(model) -> int:
    """Put the pre-hooks on every attention layer of ``model``; returns how many layers."""
    from sglang.srt.layers.radix_attention import RadixAttention

    count = 0
    for module in model.modules():
        attn, proj = getattr(module, "attn", None), getattr(module, "qkv_proj", None)
        if isinstance(attn, RadixAttention) and isinstance(proj, torch.nn.Module) and not getattr(attn, "_kvx_input_tap", False):
            proj.register_forward_pre_hook(_keeper(attn))
            attn.register_forward_pre_hook(_hand_over, with_kwargs=True)
            object.__setattr__(attn, "_kvx_input_tap", True)
            count += 1
    return count


def _wanted(attn) -> bool:
    link = link_of(attn)
    if link is None:
        return False
    runtime = link.runtime
    return runtime.recorder.wants_attention_inputs or (bool(runtime.decode) and wants_attention_inputs(runtime.decode))


def _keeper(attn):
    def keep(_proj, args):
        if args and isinstance(args[0], torch.Tensor) and _wanted(attn):
            object.__setattr__(attn, PENDING, args[0])
        return None

    return keep


def _hand_over(attn, args, kwargs):
    hidden = attn.__dict__.pop(PENDING, None)
    if hidden is None:
        return None  # nothing read this layer's input (or no qkv_proj ran): whatever needed it reports the gap
    forward_batch = kwargs.get("forward_batch", args[3] if len(args) > 3 else None)
    if forward_batch is None or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None  # graphs are captured on dummy rows
    runtime = link_of(attn).runtime
    index = runtime.compactor.layer_index.get(attn.layer_id)
    if index is None:
        return None
    batch = link_of(attn).batch(forward_batch)
    if runtime.recorder.wants_attention_inputs and batch.is_extend:
        runtime.recorder.attention_input(index, hidden, batch)
    if runtime.decode and wants_attention_inputs(runtime.decode):
        hand_attention_inputs(runtime.decode, index, hidden, batch)
    return None
