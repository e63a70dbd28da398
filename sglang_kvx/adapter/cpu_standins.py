"""Torch stand-ins for the Triton kernels SGLang's model code calls directly.

SGLang's Qwen3.5 layers call a few Triton kernels outside any backend or
registry. On the CPU platform the plugin swaps exactly these functions for the
torch versions below (see ``plugin._register_cpu_standins``); on a GPU they
are never touched.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.gdn import gated_rms_norm


def split_qkvzba_contiguous(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch version of SGLang's fused Triton split for Qwen3.5's contiguous projection layout.

    [q | k | v | z] and [b | a] become (qkv, z [n, Hv, Dv], b [n, Hv], a [n, Hv]).
    """
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    n = mixed_qkvz.shape[0]
    qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim : qkv_dim + num_heads_v * head_v].reshape(n, num_heads_v, head_v).contiguous()
    b, a = (t.contiguous() for t in mixed_ba[:, : 2 * num_heads_v].split(num_heads_v, dim=-1))
    return qkv, z, b, a


def split_qkvzba_grouped(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch version of SGLang's fused Triton split for Qwen3-Next's grouped projection layout.

    Per key head g the projection holds [q_g | k_g | v_g | z_g] (v and z: the g-th group of
    num_heads_v / num_heads_qk value heads) and [b_g | a_g]; the result is (qkv = [q | k | v],
    z [n, Hv, Dv], b [n, Hv], a [n, Hv]) with heads in order.
    """
    n = mixed_qkvz.shape[0]
    per_group = num_heads_v // num_heads_qk
    grouped = mixed_qkvz.reshape(n, num_heads_qk, 2 * head_qk + 2 * per_group * head_v)
    q, k, v, z = grouped.split([head_qk, head_qk, per_group * head_v, per_group * head_v], dim=-1)
    b, a = mixed_ba.reshape(n, num_heads_qk, 2 * per_group).split([per_group, per_group], dim=-1)
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    return (qkv, z.reshape(n, num_heads_v, head_v).contiguous(),
            b.reshape(n, num_heads_v).contiguous(), a.reshape(n, num_heads_v).contiguous())


def fused_rms_norm_gated_forward(module, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                                 prenorm: bool = False, residual_in_fp32: bool = False) -> torch.Tensor:
    """Torch forward for SGLang's ``FusedRMSNormGated`` (Qwen3-Next's GDN output norm):
    RMSNorm(x) * w * act(g), act silu/swish or sigmoid."""
    if residual is not None or prenorm:
        raise NotImplementedError("the CPU gated RMSNorm serves no residual / prenorm")
    if module.activation in ("swish", "silu"):
        return gated_rms_norm(x, g, module.weight, module.eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight.float()
    return (y * torch.sigmoid(g.float())).to(x.dtype)


def rms_norm_gated_forward(module, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    """Torch forward for SGLang's fla ``RMSNorm`` (the GDN output norm): RMSNorm(x) * w * silu(z)."""
    if not module.norm_before_gate or module.group_size is not None or module.activation not in ("swish", "silu"):
        raise NotImplementedError("the CPU gated RMSNorm serves norm-before-gate, one group, swish activation")
    if z is None:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight.float()).to(x.dtype)
    return gated_rms_norm(x, z, module.weight, module.eps)


def sigmoid_gate_mul(attn_output: torch.Tensor, gate: torch.Tensor, inplace: bool = False, quant: bool = False) -> torch.Tensor:
    """Torch version of ``fused_sigmoid_mul``: the gated-attention output, attn * sigmoid(gate)."""
    if quant:
        raise NotImplementedError("FP8 output quantisation is not served on CPU")
    gated = attn_output.float() * torch.sigmoid(gate.float()).reshape(attn_output.shape)
    if inplace:
        return attn_output.copy_(gated)
    return gated.to(attn_output.dtype)


def shared_expert_gate_add(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor,
                           final_hidden_states: torch.Tensor) -> None:
    """Torch version of ``fused_gate_sigmoid_mul_add`` (Qwen MoE's shared expert):
    final += sigmoid(hidden . w_gate) * shared, in place."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1, 1))
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))
