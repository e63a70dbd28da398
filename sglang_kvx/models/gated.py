"""The learned sigmoid-gate eviction model family, as a transformers custom model.

The paper: "Sigmoid Attention as a Better Substrate for Learned KV Cache
Eviction" (Li, arXiv 2608.23296; seeds 001/002, digest in the shared notes).
Its 2 x 2 x 2 design crosses

* attention: ``softmax`` or ``sigmoid`` (Sec. 2.2),
* positions: ``rope`` or ``nope`` (Sec. 2.1-2.2),
* gate: ``learned`` or ``none`` (Sec. 2.3),

on one GPT-2-style decoder: pre-norm blocks (LayerNorm, attention, LayerNorm,
GELU MLP), per-head QK-RMSNorm, tied token embeddings and **no** learned
absolute position vectors in any cell (Sec. 2.1: "the input representation is
the tied token embedding only"; RoPE cells rotate q and k, NoPE cells do not).

Equations, numbered here for reference in the code:

(1) q~_i = RMSNorm(q_i), k~_j = RMSNorm(k_j)                        per head
(2) (q̄_i, k̄_j) = (RoPE(q~_i, i), RoPE(k~_j, j))  [rope]  or (q~_i, k~_j)  [nope]
(3) z_ij = q̄_i·k̄_j / sqrt(d_h)
(4) softmax:  A_ij = softmax_j(z_ij)
(5) sigmoid:  A_ij = sigmoid(z_ij + b(i)),  b(i) = -log(i + 1),  i the query's
    absolute position (0-based), so row i's bias counts the i + 1 keys a causal
    query sees (the same bias added to every logit of a row is a no-op under
    softmax, so softmax cells omit it)
(6) gate of layer l < L-1:  g_j^(l) = sigmoid(w_l·x_j^(l) + b_l), one scalar per
    token shared by all heads, w_l = 0 and b_l = 5 at init (g = sigmoid(5) ~ 0.993)
(7) injected into layer l+1:  z_ij <- z_ij + log(g_j^(l) + eps),  v_j <- g_j^(l) v_j,
    eps = 1e-8, for both attention kinds; layer 0 sees no gate, the last layer
    makes none
(8) loss = CE + lambda * mean_{l < L-1, j} g_j^(l),  lambda = 0.03

What the paper leaves open and is decided here (following the authors'
public notebooks where they show it): x_j^(l) in (6) is the residual stream
at the *output* of block l (after its MLP), not normalised; the gate is a
d -> 1 linear map with a bias; the causal mask is applied after the sigmoid
(masked entries are 0); the MLP and the attention projections carry no bias;
QK-RMSNorm has a learned per-dimension scale; RoPE uses the half-split
rotation with theta = 10000.

Eviction hooks (the serving and the oracle come later): ``forward`` returns
every gate layer's ``g`` (``output.gates``, a tuple of L-1 tensors [B, T]) and
accepts ``keep_masks``: per layer ``None`` or a bool tensor of shape [B, T_k]
(the same keys for every query) or [B, T_q, T_k] (per query), False = the key
is deleted for that query. A deleted key takes no part in that layer's
attention, exactly as if it had been removed from the cache (tested against
attention over the kept keys only). Retained keys keep their gate's logit
and value scaling (7), as the paper's physical eviction does.

No KV cache: every forward recomputes the whole sequence (enough for training
and for a full-recompute oracle; a cached decode path comes with the serving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from sglang_kvx.config import GATED_MODEL_TYPE

MODEL_TYPE = GATED_MODEL_TYPE
ATTENTIONS = ("softmax", "sigmoid")
POSITIONS = ("rope", "nope")
GATES = ("gate", "none")


def cell_name(attention: str, position: str, gate: str) -> str:
    """The directory name of one design cell, e.g. ``sigmoid-nope-gate``."""
    return f"{attention}-{position}-{gate}"


ALL_CELLS = tuple(cell_name(a, p, g) for a in ATTENTIONS for p in POSITIONS for g in GATES)


def parse_cell(name: str) -> tuple[str, str, str]:
    parts = name.split("-")
    if len(parts) != 3 or parts[0] not in ATTENTIONS or parts[1] not in POSITIONS or parts[2] not in GATES:
        raise ValueError(
            f"unknown cell {name!r}: expected <{'|'.join(ATTENTIONS)}>-<{'|'.join(POSITIONS)}>-<{'|'.join(GATES)}>"
        )
    return parts[0], parts[1], parts[2]


class KvxGatedConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 512,
        attention: str = "sigmoid",
        position: str = "rope",
        gate: str = "gate",
        rope_theta: float = 10000.0,
        gate_init_bias: float = 5.0,
        gate_eps: float = 1e-8,
        gate_lambda: float = 0.03,
        rms_norm_eps: float = 1e-6,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if hidden_size % num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.attention = attention
        self.position = position
        self.gate = gate
        self.rope_theta = rope_theta
        self.gate_init_bias = gate_init_bias
        self.gate_eps = gate_eps
        self.gate_lambda = gate_lambda
        self.rms_norm_eps = rms_norm_eps
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_gates(self) -> bool:
        return self.gate == "gate"

    @property
    def cell(self) -> str:
        return cell_name(self.attention, self.position, self.gate)


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


class KvxRMSNorm(nn.Module):
    """RMSNorm with a learned scale (Zhang & Sennrich 2019), used per head on q and k (1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, H, T, D] by its absolute positions [B, T] (2), half-split pairing."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sigmoid_bias(q_positions: torch.Tensor) -> torch.Tensor:
    """b(i) = -log(i + 1) for 0-based absolute query positions (5)."""
    return -torch.log(q_positions.to(torch.float32) + 1.0)


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    kind: str,
    key_gate: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    gate_eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Equations (3)-(5) with the injection (7) and deletions; returns (output, A).

    q [B, H, Tq, D]; k, v [B, H, Tk, D] (already normed and rotated);
    q_positions [B, Tq], k_positions [B, Tk] absolute positions (causality:
    key j is visible to query i iff pos_j <= pos_i); key_gate [B, Tk] the
    previous layer's g for these keys, or None; keep [B, Tk], [B, Tq, Tk] or
    [B, H, Tq, Tk] bool, False = deleted. A is [B, H, Tq, Tk], 0 where not visible.
    """
    d = q.shape[-1]
    z = q @ k.transpose(-1, -2) / math.sqrt(d)  # (3)
    if key_gate is not None:  # (7): logit channel and value channel
        z = z + torch.log(key_gate + gate_eps)[:, None, None, :].to(z.dtype)
        v = v * key_gate[:, None, :, None].to(v.dtype)
    visible = (k_positions[:, None, :] <= q_positions[:, :, None])[:, None]  # [B, 1, Tq, Tk] causal
    if keep is not None:  # [B, Tk], [B, Tq, Tk] or per head [B, H, Tq, Tk]
        visible = visible & {2: lambda m: m[:, None, None, :], 3: lambda m: m[:, None], 4: lambda m: m}[keep.dim()](keep)
    if kind == "softmax":  # (4)
        a = torch.softmax(z.masked_fill(~visible, float("-inf")), dim=-1)
        a = torch.nan_to_num(a, nan=0.0)  # a query with every key deleted attends to nothing
    elif kind == "sigmoid":  # (5)
        b = sigmoid_bias(q_positions)[:, None, :, None].to(z.dtype)
        a = torch.sigmoid(z + b) * visible
    else:
        raise ValueError(f"unknown attention kind {kind!r}")
    return a @ v, a


KeepFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def _and_keep(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two keep masks of any accepted shape, as one [B, H or 1, Tq, Tk]."""
    lift = {2: lambda m: m[:, None, None, :], 3: lambda m: m[:, None], 4: lambda m: m}
    return lift[a.dim()](a) & lift[b.dim()](b)


class KvxAttention(nn.Module):
    def __init__(self, config: KvxGatedConfig) -> None:
        super().__init__()
        self.config = config
        self.n_head = config.num_attention_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.q_norm = KvxRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = KvxRMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.head_dim).transpose(1, 2)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        key_gate: torch.Tensor | None,
        keep: torch.Tensor | None,
        keep_fn: KeepFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(self._heads(self.q_proj(h)))  # (1)
        k = self.k_norm(self._heads(self.k_proj(h)))
        v = self._heads(self.v_proj(h))
        if self.config.position == "rope":  # (2)
            q = rope(q, positions, self.config.rope_theta)
            k = rope(k, positions, self.config.rope_theta)
        if keep_fn is not None:  # an eviction rule that reads this layer's q, k and incoming gate
            ruled = keep_fn(q, k, key_gate)
            if ruled is not None:
                keep = ruled if keep is None else _and_keep(keep, ruled)
        out, a = gated_attention(
            q, k, v, positions, positions, self.config.attention,
            key_gate=key_gate, keep=keep, gate_eps=self.config.gate_eps,
        )
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), a


class KvxTokenGate(nn.Module):
    """g_j = sigmoid(w·x_j + b): one scalar per token (6); w = 0, b = 5 at init."""

    def __init__(self, config: KvxGatedConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.hidden_size))
        self.bias = nn.Parameter(torch.full((), float(config.gate_init_bias)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.weight + self.bias)  # [B, T]


class KvxMLP(nn.Module):
    def __init__(self, config: KvxGatedConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class KvxBlock(nn.Module):
    """Pre-norm block; makes the gate (6) for the next layer unless it is the last one."""

    def __init__(self, config: KvxGatedConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = KvxAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = KvxMLP(config)
        makes_gate = config.has_gates and layer_idx < config.num_hidden_layers - 1
        self.gate = KvxTokenGate(config) if makes_gate else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_gate: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        keep_fn: KeepFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        attn_out, a = self.attn(self.ln_1(x), positions, key_gate, keep, keep_fn)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        g = self.gate(x) if self.gate is not None else None  # (6), from block l's output
        return x, g, a


# ---------------------------------------------------------------------------
# transformers classes
# ---------------------------------------------------------------------------


@dataclass
class KvxGatedOutput(ModelOutput):
    """loss = ce_loss + gate_lambda * gate_mean (8); gates: L-1 tensors [B, T] (gated cells)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    gate_mean: torch.Tensor | None = None
    gates: tuple[torch.Tensor, ...] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class KvxGatedPreTrainedModel(PreTrainedModel):
    config_class = KvxGatedConfig
    base_model_prefix = "model"
    _no_split_modules = ["KvxBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        from transformers import initialization as init

        std = self.config.initializer_range
        if isinstance(module, KvxTokenGate):  # (6): w = 0, b = 5
            init.zeros_(module.weight)
            init.constant_(module.bias, self.config.gate_init_bias)
        elif isinstance(module, KvxRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class KvxGatedModel(KvxGatedPreTrainedModel):
    """The decoder trunk: token embedding (no position vector), blocks, final LayerNorm."""

    def __init__(self, config: KvxGatedConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([KvxBlock(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        keep_masks: list[torch.Tensor | None] | tuple | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        keep_fns: list[KeepFn | None] | tuple | None = None,
    ) -> tuple[torch.Tensor, tuple, tuple | None, tuple | None]:
        """Returns (final hidden [B, T, d], gates, hidden_states, attentions).

        position_ids: absolute positions [B, T] (default 0..T-1), used by RoPE and b(i).
        keep_masks: one entry per layer (None = keep all), see the module docstring.
        keep_fns: one entry per layer (None = no rule): ``fn(q, k, key_gate)`` -> a keep mask, for
        eviction rules that depend on what the forward computes (gates, keys, attention).
        attention_mask: HF-style [B, T] 1/0 over keys, applied in every layer.
        """
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        if keep_masks is not None and len(keep_masks) != len(self.layers):
            raise ValueError(f"keep_masks needs one entry per layer ({len(self.layers)}), got {len(keep_masks)}")
        x = self.embed_tokens(input_ids)
        gates: list[torch.Tensor] = []
        hiddens = [x] if output_hidden_states else None
        attns = [] if output_attentions else None
        prev_gate = None  # layer 0 sees no gate (7)
        for i, layer in enumerate(self.layers):
            keep = keep_masks[i] if keep_masks is not None else None
            if attention_mask is not None:
                pad_keep = attention_mask.bool()
                keep = pad_keep if keep is None else (keep & (pad_keep if keep.dim() == 2 else pad_keep[:, None, :]))
            keep_fn = keep_fns[i] if keep_fns is not None else None
            x, g, a = layer(x, position_ids, key_gate=prev_gate, keep=keep, keep_fn=keep_fn)
            if g is not None:
                gates.append(g)
            prev_gate = g
            if output_hidden_states:
                hiddens.append(x)
            if output_attentions:
                attns.append(a)
        x = self.ln_f(x)
        return x, tuple(gates), (tuple(hiddens) if hiddens is not None else None), (
            tuple(attns) if attns is not None else None
        )


class KvxGatedForCausalLM(KvxGatedPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KvxGatedConfig) -> None:
        super().__init__(config)
        self.model = KvxGatedModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        keep_masks: list[torch.Tensor | None] | tuple | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        keep_fns: list[KeepFn | None] | tuple | None = None,
        **kwargs,
    ) -> KvxGatedOutput:
        """labels: HF convention (same shape as input_ids, shifted inside, -100 ignored)."""
        h, gates, hiddens, attns = self.model(
            input_ids, position_ids=position_ids, keep_masks=keep_masks, attention_mask=attention_mask,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions, keep_fns=keep_fns,
        )
        logits = self.lm_head(h)
        # (8): mean over the L-1 gate layers and all tokens (equal T per layer, so the
        # mean of the stacked gates is the paper's 1/((L-1)T) double sum).
        gate_mean = torch.stack(gates).mean() if gates else None
        ce = loss = None
        if labels is not None:
            ce = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            loss = ce + self.config.gate_lambda * gate_mean if gate_mean is not None else ce
        return KvxGatedOutput(
            loss=loss, logits=logits, ce_loss=ce, gate_mean=gate_mean, gates=gates if gates else None,
            hidden_states=hiddens, attentions=attns,
        )


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know ``kvx_gated_gpt`` (idempotent, offline)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, KvxGatedConfig, exist_ok=True)
    AutoModel.register(KvxGatedConfig, KvxGatedModel, exist_ok=True)
    AutoModelForCausalLM.register(KvxGatedConfig, KvxGatedForCausalLM, exist_ok=True)


def build_model(cell: str, seed: int = 0, **config_kwargs) -> KvxGatedForCausalLM:
    """A freshly initialised model of one cell. The gate's init is constant, so the
    shared weights of a gated cell and its no-gate twin are identical for one seed."""
    attention, position, gate = parse_cell(cell)
    config = KvxGatedConfig(attention=attention, position=position, gate=gate, **config_kwargs)
    torch.manual_seed(seed)
    return KvxGatedForCausalLM(config)
