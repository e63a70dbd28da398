"""The torch GDN ops against independent references: the plain recurrence, transformers' fallback, F.conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_kvx.ops.gdn import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_step,
    gdn_gates,
)


def random_inputs(T: int, Hk: int = 2, Hv: int = 4, D: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, D, generator=gen)
    k = torch.randn(T, Hk, D, generator=gen)
    v = torch.randn(T, Hv, D, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 2.0  # log-decay <= 0
    beta = torch.rand(T, Hv, generator=gen)
    state = torch.randn(Hv, D, D, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrence(T, with_state):
    q, k, v, g, beta, state = random_inputs(T, seed=T)
    state = state if with_state else torch.zeros_like(state)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, g, beta, state)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, state if with_state else None)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def test_chunked_matches_transformers_fallback():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = random_inputs(150, seed=1)
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, state)
    # transformers takes batch-first tensors and expects key heads already shared across value heads.
    rep = v.shape[1] // q.shape[1]
    o_hf, s_hf = torch_chunk_gated_delta_rule(
        q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None], v[None], g[None], beta[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_hf[0], atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_steps_continue_the_sequence():
    q, k, v, g, beta, _ = random_inputs(100, seed=2)
    o_all, s_all = gated_delta_rule_chunked(q, k, v, g, beta)
    _, s = gated_delta_rule_chunked(q[:90], k[:90], v[:90], g[:90], beta[:90])
    S = s[None]
    for t in range(90, 100):
        o_t, S = gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], S)
        torch.testing.assert_close(o_t[0], o_all[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S[0], s_all, atol=1e-5, rtol=1e-5)


def test_causal_conv_matches_conv1d_and_carries_state():
    gen = torch.Generator().manual_seed(3)
    T, C, K = 37, 6, 4
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen)
    expected = F.silu(F.conv1d(x.T[None], w[:, None, :], bias, padding=K - 1, groups=C)[0, :, :T]).T
    y, state = causal_conv1d(x, w, bias, None, "silu")
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-(K - 1) :].T)
    # Two pieces with the state carried between them equal one pass.
    y1, s1 = causal_conv1d(x[:20], w, bias, None, "silu")
    y2, s2 = causal_conv1d(x[20:], w, bias, s1, "silu")
    torch.testing.assert_close(torch.cat([y1, y2]), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s2, state)
    # Token by token from the prefix's state: the decode step continues the same convolution.
    y_steps, carried = [], s1[None]
    for t in range(20, T):
        y_t, carried = causal_conv1d_step(x[t : t + 1], carried, w, bias, "silu")
        y_steps.append(y_t)
    torch.testing.assert_close(torch.cat(y_steps), expected[20:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(carried[0], state)


def test_gates_follow_the_definition():
    A_log = torch.tensor([0.0, 1.0])
    dt_bias = torch.tensor([0.5, -0.5])
    a = torch.tensor([[0.1, 0.2]])
    b = torch.tensor([[0.0, 3.0]])
    g, beta = gdn_gates(A_log, a, b, dt_bias)
    torch.testing.assert_close(g, -torch.exp(A_log) * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, torch.sigmoid(b))
    assert (g <= 0).all()
