"""KVzip's context-reconstruction pass in HF transformers: the offline producer of
ContextSignals.reconstruction_attention (see sglang_kvx.policies.kvzip for the definition).

The context is prefilled once; each reconstruction pass then runs on a copy of that cache (GDN
states included), through an attention function registered in transformers' AttentionInterface
that attends exactly like the compaction oracle's (every cached entry plus the pass's own keys up
to each query) and folds the pass's queries and keys into the score.

    signals = context_signals(ref, ids, protected_prefix_len=p)
    signals.reconstruction_attention = reconstruction_attention(ref, ids, protected_prefix_len=p)

With ``plus=True`` the score is KVzip+'s: each pass layer's ||h_j|| is tapped from the attention
module's input (a forward pre-hook) and ||W_O^h v_i|| computed through the layer's own ``o_proj``
weights, head slice by head slice (the server takes the Gram route, ``policies.kvzip.OutputProjections``).
"""

from __future__ import annotations

import copy

import torch

from sglang_kvx.policies.kvzip import (
    CHUNK_SIZE,
    accumulate_reconstruction_attention,
    reconstruction_inputs,
    reconstruction_prompt_ids,
)
from sglang_kvx.reference.hf import HFReference, _compacted_attention

RECONSTRUCTION_ATTENTION = "kvx_kvzip_reconstruction"


class _Pass:
    def __init__(self, totals: list[torch.Tensor], layer_of: dict[int, int], start: int, end: int, prefix: int,
                 plus: bool = False) -> None:
        self.totals, self.layer_of, self.start, self.end, self.prefix = totals, layer_of, start, end, prefix
        self.plus = plus
        self.hidden_norms: dict[int, torch.Tensor] = {}  # model layer -> ||h_j|| of the pass's tokens


def output_value_norms(module, values: torch.Tensor) -> torch.Tensor:
    """||W_O^h v_i|| per query head h and entry i: [Hq, n] from values [Hkv, n, D], through the
    attention module's ``o_proj`` weight one head slice at a time."""
    num_q_heads = module.config.num_attention_heads
    head_dim = values.shape[-1]
    weight = module.o_proj.weight.float()  # [hidden, Hq * D]
    group = num_q_heads // values.shape[0]
    return torch.stack([(values[h // group].float() @ weight[:, h * head_dim : (h + 1) * head_dim].T).norm(dim=-1)
                        for h in range(num_q_heads)])


_active: _Pass | None = None


def _scoring_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The oracle's attention over [cached context ; this pass], recording KVzip's score on the side."""
    out, _ = _compacted_attention(module, query, key, value, attention_mask, scaling)
    scoring = _active
    if scoring is not None:
        layer = scoring.layer_of[module.layer_idx]
        plus = None
        if scoring.plus:
            n = key.shape[2] - query.shape[2]
            plus = (output_value_norms(module, value[0, :, :n]), scoring.hidden_norms[module.layer_idx])
        accumulate_reconstruction_attention(
            scoring.totals[layer], query[0], key[0], scoring.start, scoring.end,
            protected_prefix_len=scoring.prefix, scaling=scaling, plus=plus,
        )
    return out, None


def _record_hidden_norm(module, args, kwargs):
    """Pre-hook on an attention module: the pass tokens' input hidden-state norms (KVzip+'s ||h_j||)."""
    if _active is not None and _active.plus:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _active.hidden_norms[module.layer_idx] = hidden[0].float().norm(dim=-1)


@torch.no_grad()
def reconstruction_attention(
    ref: HFReference,
    context_ids: list[int],
    *,
    protected_prefix_len: int = 0,
    chunk_size: int = CHUNK_SIZE,
    prompt: tuple[list[int], list[int], list[int]] | None = None,
    plus: bool = False,
) -> list[torch.Tensor]:
    """KVzip's score of every context entry (KVzip+'s with ``plus``): per attention layer [kv_heads, n] float32.

    ``prompt`` overrides (prompt, continuation, postfix) ids; by default they come from the tokenizer.
    """
    global _active
    from transformers import AttentionInterface

    model, config = ref.model, ref.model.config
    prompt_ids, continuation_ids, postfix_ids = prompt if prompt is not None else reconstruction_prompt_ids(ref.tokenizer)
    n = len(context_ids)
    passes = reconstruction_inputs(
        context_ids, prompt_ids, continuation_ids, postfix_ids,
        protected_prefix_len=protected_prefix_len, chunk_size=chunk_size,
    )
    cache = model(torch.tensor([context_ids]), use_cache=True, logits_to_keep=1).past_key_values
    layer_of = {layer_id: i for i, layer_id in enumerate(ref.attention_layer_ids)}
    totals = [torch.zeros(config.num_key_value_heads, n) for _ in layer_of]

    AttentionInterface.register(RECONSTRUCTION_ATTENTION, _scoring_attention)
    previous = config._attn_implementation
    model.set_attn_implementation(RECONSTRUCTION_ATTENTION)
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(_record_hidden_norm, with_kwargs=True)
             for i in ref.attention_layer_ids] if plus else []
    try:
        for start, end, ids in passes:
            positions = torch.arange(n, n + len(ids))
            _active = _Pass(totals, layer_of, start, end, protected_prefix_len, plus=plus)
            model(
                torch.tensor([ids]), position_ids=positions[None], cache_position=positions,
                past_key_values=copy.deepcopy(cache), use_cache=True,
            )
    finally:
        _active = None
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    return totals
