"""What one prefill of a context exposes to a policy.

Everything is per context (one sequence) and per attention layer, indexed in
attention-layer order (0 = the model's first full-attention layer). Tensors
are float32 on the device the prefill ran on. A policy reads only the fields
named in its ``needs``; the producer fills only what some policy asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GDNLayerSignals:
    """Per token and value head of one Gated-DeltaNet layer (all [n, Hv])."""

    beta: torch.Tensor  # write gate, sigmoid(b)
    g: torch.Tensor  # log-decay, <= 0
    v_norm: torch.Tensor  # ||v_t|| after the causal conv

    @property
    def effective_write(self) -> torch.Tensor:
        return self.beta * self.v_norm


@dataclass
class ContextSignals:
    """Signals of one prefilled context of ``n`` tokens.

    keys / values: per attention layer [kv_heads, n, head_dim]; keys after RoPE, as cached.
    window_queries: per attention layer [q_heads, w, head_dim], the queries (after RoPE) of the
        last w context tokens: SnapKV's observation window.
    attention_column_sums: per attention layer [q_heads, n], sum over every context query of its
        softmax attention to each key (H2O's accumulated attention).
    output_gate: per attention layer [n, q_heads], mean |sigmoid(gate)| of the gated attention output.
    gdn: per GDN layer, in model order; gdn_layer_of_attention[l] = how many GDN layers precede
        attention layer l (its signals are gdn[:gdn_layer_of_attention[l]]).
    protected_prefix_len: the first tokens every policy keeps, outside the budget.
    """

    n: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor] | None = None
    attention_column_sums: list[torch.Tensor] | None = None
    output_gate: list[torch.Tensor] | None = None
    gdn: list[GDNLayerSignals] = field(default_factory=list)
    gdn_layer_of_attention: list[int] = field(default_factory=list)
    protected_prefix_len: int = 0
    rope_theta: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (GQA)."""
        return self.num_q_heads // self.num_kv_heads
