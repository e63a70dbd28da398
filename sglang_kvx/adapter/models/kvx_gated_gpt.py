"""SGLang's side of the learned-gate model family (``models/gated.py``): the same modules and
weights, the attention over SGLang's paged pool through the ``kvx_gated`` backend.

The blocks are the transformers model's own modules (projections, QK-RMSNorm, RoPE, MLP, gate),
so one set of weights and one definition of each piece serve both; only the attention call
differs: each layer's RadixAttention hands the backend the gate its previous layer wrote for the
batch's tokens (``key_gate``), which the backend stores beside the pool and applies to every key.
Tensor parallelism is not supported (the family is tiny: plain torch linears).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_kvx.models.gated import KvxGatedConfig, KvxGatedModel, rope


class KvxGatedForCausalLM(nn.Module):
    """Named as the checkpoints' ``architectures`` entry, which is how SGLang's registry finds it."""

    def __init__(self, config: KvxGatedConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().tp_size > 1:
            raise ValueError("kvx_gated_gpt is served with --tp-size 1 only")
        if quant_config is not None:
            raise ValueError("kvx_gated_gpt is not served quantised")
        self.config = config
        self.model = KvxGatedModel(config)
        heads, head_dim = config.num_attention_heads, config.head_dim
        self.attn = nn.ModuleList()
        for layer_id in range(config.num_hidden_layers):
            attention = RadixAttention(heads, head_dim, scaling=head_dim ** -0.5, num_kv_heads=heads, layer_id=layer_id)
            attention.kvx_attention_kind = config.attention  # read by the kvx_gated backend
            self.attn.append(attention)
        self.logits_processor = LogitsProcessor(config)

    def _attention(self, i: int, h: torch.Tensor, positions: torch.Tensor, key_gate: torch.Tensor | None,
                   forward_batch: ForwardBatch) -> torch.Tensor:
        block = self.model.layers[i].attn
        tokens = h.shape[0]
        q = block.q_norm(block.q_proj(h).view(tokens, block.n_head, block.head_dim))
        k = block.k_norm(block.k_proj(h).view(tokens, block.n_head, block.head_dim))
        v = block.v_proj(h).view(tokens, block.n_head, block.head_dim)
        if self.config.position == "rope":  # the model's rotation on [1, H, T, D]
            q = rope(q.transpose(0, 1)[None], positions[None], self.config.rope_theta)[0].transpose(0, 1)
            k = rope(k.transpose(0, 1)[None], positions[None], self.config.rope_theta)[0].transpose(0, 1)
        out = self.attn[i](q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1), forward_batch,
                           key_gate=key_gate)
        return block.o_proj(out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch, **_kwargs):
        x = self.model.embed_tokens(input_ids)
        key_gate = None  # layer 0 sees no gate
        for i, layer in enumerate(self.model.layers):
            x = x + self._attention(i, layer.ln_1(x), positions, key_gate, forward_batch)
            x = x + layer.mlp(layer.ln_2(x))
            key_gate = layer.gate(x) if layer.gate is not None else None
        hidden = self.model.ln_f(x)
        return self.logits_processor(input_ids, hidden, self.model.embed_tokens, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue  # tied to the token embedding
            key = name.removeprefix("model.")
            if key not in params:
                raise ValueError(f"kvx_gated_gpt: unexpected weight {name!r} in the checkpoint")
            with torch.no_grad():
                params[key].copy_(tensor.to(params[key].dtype))
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"kvx_gated_gpt: weights missing from the checkpoint: {missing[:4]}")


EntryClass = KvxGatedForCausalLM
