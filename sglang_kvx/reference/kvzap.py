"""KVzap's HF producers: each attention layer's input hidden states, the KVzip+ targets the surrogates
learn, and the decode rule applied step by step (the oracle of ``decode/kvzap.py``).

    hidden = attention_inputs(ref, ids)          # per attention layer [n, hidden]
    targets = kvzip_plus_targets(ref, ids)       # per attention layer [kv_heads, n]: log KVzip+

The hidden states are tapped with a forward pre-hook on each attention module (what its q/k/v
projections read: after the layer's input norm), in one plain forward.
"""

from __future__ import annotations

import torch

from sglang_kvx.policies.kvzap import KVzapSurrogate
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


@torch.no_grad()
def kvzap_generate(ref: HFReference, prompt_ids: list[int], max_new_tokens: int, surrogate: KVzapSurrogate, threshold: float,
                   window: int) -> tuple[list[int], list[float], dict]:
    """Greedy generation under KVzap's decode rule, applied here step by step: every token is scored
    from its attention-input hidden states when it is written (the prompt in its prefill, each new
    token in its step); at a step with S keys each (layer, KV head) reads the last ``window`` entries
    before the current one, the current one, and every older entry whose score >= ``threshold``.
    Dropped entries are masked out of HF's cache per head (``kvx_prefix_valid``), nothing is recomputed.
    Returns the tokens, their log-probabilities and {"dropped": [per layer [H, n] bool of the entries
    decided and dropped when the last step ran], "scores": per layer [H, n]}."""
    from sglang_kvx.reference.hf import ORACLE_ATTENTION, take_greedy

    model = ref.model
    scores: dict[int, list[torch.Tensor]] = {i: [] for i in ref.attention_layer_ids}
    layer_of = {layer_id: i for i, layer_id in enumerate(ref.attention_layer_ids)}

    def tap(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        scores[module.layer_idx].append(surrogate.score(layer_of[module.layer_idx], hidden[0].float()))

    def dropped(seq_len: int) -> dict[int, torch.Tensor]:
        """Per model layer [H, seq_len - 1]: entries a step with ``seq_len`` keys does not read."""
        decided = max(0, seq_len - 1 - window)
        out = {}
        for layer_id in ref.attention_layer_ids:
            s = torch.cat(scores[layer_id], dim=-1)[:, : seq_len - 1]
            gone = torch.zeros_like(s, dtype=torch.bool)
            gone[:, :decided] = s[:, :decided] < threshold
            out[layer_id] = gone
        return out

    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(tap, with_kwargs=True) for i in ref.attention_layer_ids]
    try:
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        tokens: list[int] = []
        logprobs: list[float] = []
        with ref.oracle_attention(ORACLE_ATTENTION):
            while take_greedy(logits, tokens, logprobs) < max_new_tokens:
                seq_len = len(prompt_ids) + len(tokens)
                valid = {layer_id: ~gone for layer_id, gone in dropped(seq_len).items()}
                position = torch.tensor([[seq_len - 1]])
                logits = model(torch.tensor([tokens[-1:]]), position_ids=position, cache_position=position[0],
                               past_key_values=cache, use_cache=True, kvx_prefix_valid=valid).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
    final = len(prompt_ids) + len(tokens)  # a step after the last would read this many keys
    return tokens, logprobs, {"dropped": [dropped(final)[i] for i in ref.attention_layer_ids],
                              "scores": [torch.cat(scores[i], dim=-1) for i in ref.attention_layer_ids]}
