"""KVzap's HF producers: each attention layer's input hidden states, the KVzip+ targets the surrogates
learn, and the decode rule applied step by step (the oracle of ``decode/kvzap.py``).

    hidden = attention_inputs(ref, ids)          # per attention layer [n, hidden]
    targets = kvzip_plus_targets(ref, ids)       # per attention layer [kv_heads, n]: log KVzip+

The hidden states are tapped with a forward pre-hook on each attention module (what its q/k/v
projections read: after the layer's input norm), in one plain forward.
"""

from __future__ import annotations

import torch

from sglang_kvx.reference.hf import HFReference
from sglang_kvx.reference.kvzip import reconstruction_attention


@torch.no_grad()
def attention_inputs(ref: HFReference, ids: list[int]) -> list[torch.Tensor]:
    """Per attention layer, the input hidden states of every token: [n, hidden] float32."""
    model = ref.model
    captured: dict[int, torch.Tensor] = {}

    def tap(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured[module.layer_idx] = hidden[0].float().clone()

    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(tap, with_kwargs=True)
             for i in ref.attention_layer_ids]
    try:
        model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return [captured[i] for i in ref.attention_layer_ids]


@torch.no_grad()
def kvzip_plus_targets(ref: HFReference, ids: list[int], *, chunk_size: int | None = None,
                       with_inputs: bool = False) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """log KVzip+ of every entry of the context ``ids``, per attention layer [kv_heads, n] (the
    surrogates' regression targets: the paper's Eq. 3 in log space, from our reconstruction pass).
    ``with_inputs``: also each attention layer's input hidden states [n, hidden], tapped from the
    same context prefill the pass runs on (one forward fewer than ``attention_inputs``)."""
    options = {} if chunk_size is None else {"chunk_size": chunk_size}
    model, n = ref.model, len(ids)
    captured: dict[int, torch.Tensor] = {}

    def tap(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if hidden.shape[1] == n and module.layer_idx not in captured:  # the context's prefill, not a pass
            captured[module.layer_idx] = hidden[0].float().clone()

    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(tap, with_kwargs=True)
             for i in ref.attention_layer_ids] if with_inputs else []
    try:
        targets = [total.clamp_min(1e-30).log() for total in reconstruction_attention(ref, ids, plus=True, **options)]
    finally:
        for hook in hooks:
            hook.remove()
    return (targets, [captured[i] for i in ref.attention_layer_ids]) if with_inputs else targets
