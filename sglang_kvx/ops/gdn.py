"""Gated-DeltaNet ops, torch reference (the source of truth; runs on any device).

Shapes follow one convention throughout: tokens first, then heads.
    q, k: [T, Hk, Dk]    v: [T, Hv, Dv]    g, beta: [T, Hv]
    recurrent state: [Hv, Dk, Dv]   (state^T k reads a value; k v^T writes one)
    conv state: [C, K-1] (the last K-1 inputs of each channel, oldest first)

The recurrence, for every token t and value head h:
    S <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)        # the delta: what the state gets wrong
    S <- S + k_t u_t^T
    o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and value head: log-decay g = -exp(A_log) * softplus(a + dt_bias), write gate beta = sigmoid(b)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise, scale q, and share each key head across its group of value heads."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    group = num_v_heads // k.shape[-2]
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q, k


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences: q,k [B,Hk,Dk], v [B,Hv,Dv], g,beta [B,Hv], state [B,Hv,Dk,Dv]."""
    q, k = _prepare_qk(q, k, v.shape[-2])
    S = state.float() * torch.exp(g.float())[..., None, None]
    read = torch.einsum("bhkv,bhk->bhv", S, k)
    u = beta.float()[..., None] * (v.float() - read)
    S = S + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence over one sequence (the reference for the chunked form). Returns (o [T,Hv,Dv], state)."""
    S = state.float()[None]
    outs = []
    for t in range(v.shape[0]):
        o, S = gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], S)
        outs.append(o)
    return torch.cat(outs), S[0]


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of the same recurrence (prefill). Returns (o [T,Hv,Dv], final state [Hv,Dk,Dv]).

    Inside a chunk with cumulative log-decay c_i (inclusive) and start state S0,
    the deltas U solve the unit lower-triangular system
        (I + A) U = beta * V - beta * exp(c) * (K S0),   A_ij = beta_i exp(c_i - c_j) k_i.k_j  (j < i)
    then  o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j
    and   S_end = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T.
    """
    T, Hv, Dv = v.shape
    q, k = _prepare_qk(q, k, Hv)
    Dk = k.shape[-1]
    v, g, beta = v.float(), g.float(), beta.float()
    S = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device) if state is None else state.float().clone()
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        # heads first: [H, C, D]
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        bc = beta[start:end].transpose(0, 1)  # [H, C]
        cum = g[start:end].transpose(0, 1).cumsum(dim=-1)  # [H, C]
        C = end - start
        lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf"))
        decay = torch.exp(diff)  # [H, C, C], exp(c_i - c_j) for j <= i, else 0
        kk = kc @ kc.transpose(-1, -2)
        A = (bc[:, :, None] * kk * decay).tril(-1)
        eye = torch.eye(C, dtype=torch.float32, device=v.device).expand_as(A)
        rhs = bc[:, :, None] * (vc - torch.exp(cum)[:, :, None] * (kc @ S))
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay
        out[start:end] = (torch.exp(cum)[:, :, None] * (qc @ S) + qk @ U).transpose(0, 1)
        last = cum[:, -1:]
        S = torch.exp(last)[:, :, None] * S + (kc * torch.exp(last - cum)[:, :, None]).transpose(-1, -2) @ U
    return out, S


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor | None, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence x [T, C] with kernel weight [C, K].

    ``conv_state`` [C, K-1] holds the K-1 inputs before x (zeros when None).
    Returns (y [T, C], new conv state [C, K-1]).
    """
    T, C = x.shape
    K = weight.shape[-1]
    history = torch.zeros(C, K - 1, dtype=x.dtype, device=x.device) if conv_state is None else conv_state.to(x.dtype)
    padded = torch.cat([history.transpose(0, 1), x]).float()  # [K-1+T, C], time-major like x
    w = weight.float()
    # K shifted multiply-adds over contiguous rows (an unfold over time is ~10x slower on CPU).
    y = padded[0:T] * w[:, 0]
    for k in range(1, K):
        y = y + padded[k : k + T] * w[:, k]
    if bias is not None:
        y = y + bias.float()
    new_state = padded[T:].transpose(0, 1).to(x.dtype).contiguous()  # the last K-1 inputs, [C, K-1]
    return _activate(y, activation).to(x.dtype), new_state


def causal_conv1d_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x [B, C], conv_state [B, C, K-1] -> (y [B, C], new state [B, C, K-1])."""
    window = torch.cat([conv_state, x[:, :, None].to(conv_state.dtype)], dim=-1)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return y


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: RMSNorm(x) * weight * silu(z), per head (last dim)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(z.float())).to(x.dtype)
