"""GateSight scoring: every (attention layer, KV head) estimator over every context entry, one op.

    features [L, n, F]  ->  relu(features @ w1[l, h] + b1[l, h]) @ w2[l, h] + b2[l, h]  ->  utility [L, H, n]

w1 [L, H, F, U], b1 [L, H, U], w2 [L, H, U], b2 [L, H]; one hidden layer of U units per estimator.
Feature standardisation is folded into w1 / b1 by the estimator, so this op reads raw features.
``mlp_utility`` runs the Triton kernel for CUDA tensors (or under TRITON_INTERPRET=1 when asked)
and the torch reference otherwise; the reference is the source of truth.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.dispatch import choose, run


def mlp_utility_reference(
    features: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    _check_shapes(features, w1, b1, w2, b2)
    num_layers, n, num_features = features.shape
    heads, units = w1.shape[1], w1.shape[3]
    out = []
    for layer in range(num_layers):
        # Every head of a layer reads the same features: one [n, F] x [F, H*U] product for all of them.
        w1_all_heads = w1[layer].float().permute(1, 0, 2).reshape(num_features, heads * units)
        hidden = torch.addmm(b1[layer].float().reshape(1, -1), features[layer].float(), w1_all_heads).relu_()
        utility = hidden.view(n, heads, units).mul_(w2[layer].float()).sum(dim=-1)  # [n, H]
        out.append(utility.t() + b2[layer].float()[:, None])
    return torch.stack(out) if out else features.new_zeros(0, heads, n)


def mlp_utility(
    features: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    impl: str | None = None,
) -> torch.Tensor:
    """[L, H, n] float32 utilities. impl: see ``ops/dispatch.py`` (op ``gatesight_utility``; auto:
    Triton on CUDA, torch elsewhere)."""

    def triton(*args):
        from sglang_kvx.ops.triton_gatesight import mlp_utility_triton

        _check_shapes(*args)
        return mlp_utility_triton(*args)

    return run("gatesight_utility", impl, choose("gatesight_utility", impl, features.device), mlp_utility_reference,
               {"triton": triton}, features, w1, b1, w2, b2)



def _check_shapes(features, w1, b1, w2, b2) -> None:
    if features.dim() != 3 or w1.dim() != 4:
        raise ValueError(f"features must be [L, n, F] and w1 [L, H, F, U], got {tuple(features.shape)} and {tuple(w1.shape)}")
    num_layers, _, num_features = features.shape
    layers, heads, f, units = w1.shape
    if (layers, f) != (num_layers, num_features):
        raise ValueError(f"w1 {tuple(w1.shape)} does not match features {tuple(features.shape)}")
    if tuple(b1.shape) != (layers, heads, units) or tuple(w2.shape) != (layers, heads, units) or tuple(b2.shape) != (layers, heads):
        raise ValueError(
            f"expected b1/w2 [{layers}, {heads}, {units}] and b2 [{layers}, {heads}], "
            f"got {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}"
        )
