"""``snapkv``: score every entry by how much the context's last tokens attend to it.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024,
arXiv:2404.14469). The observation window is the last w context tokens. Their queries' softmax
attention to the keys, summed over the window and over the query heads sharing a KV head
(the GQA fix of the SnapKV repo's issue 22), is 1-D average-pooled over positions (kernel 5,
stride 1, zero-padded) so neighbours of a hit survive with it. The window's own entries always
stay. Defaults w = 64, kernel 5, average pooling: the SnapKV repo's snapkv_utils defaults.

Against kvpress's SnapKVPress: kvpress averages over the window and over the group where this
sums (a constant factor per layer, so the same ranking; pooling is linear, so pooling before or
after the group changes nothing). Window marking: kvpress pads the window with the largest
pre-window score (over all heads), a tie top-K may break against a window entry; here the window
scores +inf, so it is always kept first. The count kept is round(p * m), kvpress's int(p * n).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sglang_kvx.policies.base import KVPolicy, layer_signal, register_policy
from sglang_kvx.signals import CaptureSpec, ContextSignals


def observation_window_attention(window_queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention of the last w context queries to all n keys, summed per KV group: -> [kv_heads, n].

    window_queries [q_heads, w, head_dim] are the queries of positions n-w .. n-1 (after RoPE, like
    the keys [kv_heads, n, head_dim]); each attends causally, with the usual 1/sqrt(head_dim) scale.
    """
    num_q_heads, w, head_dim = window_queries.shape
    num_kv_heads, n, _ = keys.shape
    group_size = num_q_heads // num_kv_heads
    query_position = torch.arange(n - w, n, device=keys.device)[:, None]
    future = torch.arange(n, device=keys.device)[None, :] > query_position  # [w, n]
    summed = torch.empty(num_kv_heads, n, dtype=torch.float32, device=keys.device)
    # One KV group at a time: the [group, w, n] logits stay small even for long contexts.
    for kv_head in range(num_kv_heads):
        queries = window_queries[kv_head * group_size : (kv_head + 1) * group_size].float()
        logits = queries @ keys[kv_head].float().T / math.sqrt(head_dim)  # [group, w, n]
        logits = logits.masked_fill(future, float("-inf"))
        summed[kv_head] = logits.softmax(dim=-1).sum(dim=(0, 1))
    return summed


@register_policy("snapkv")
class SnapKVPolicy(KVPolicy):
    needs = frozenset({"keys", "attention"})

    def __init__(self, *, window_size: int = 64, kernel_size: int = 5, pooling: str = "avg") -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd number (pooling keeps the length), got {kernel_size}")
        if pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max', got {pooling!r}")
        self.window_size = window_size
        self.kernel_size = kernel_size
        self.pooling = pooling

    def captures(self) -> CaptureSpec:
        return CaptureSpec(window=self.window_size)

    def score(self, signals: ContextSignals, layer: int, budget: int | None = None) -> torch.Tensor:
        keys = layer_signal(signals, "keys", layer, self.name)
        window_queries = layer_signal(signals, "window_queries", layer, self.name)
        n = keys.shape[1]
        if window_queries.shape[1] > n:
            raise ValueError(f"{window_queries.shape[1]} window queries for a context of only {n} tokens")
        # The producer may have captured fewer queries than our window; the window is what it gave.
        w = min(self.window_size, window_queries.shape[1])
        attention = observation_window_attention(window_queries[:, window_queries.shape[1] - w :], keys)
        before_window = attention[:, : n - w]
        if self.kernel_size > 1 and before_window.shape[1] > 0:
            pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
            before_window = pool(before_window[:, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)[:, 0]
        window = torch.full((keys.shape[0], w), float("inf"), device=keys.device)
        return torch.cat([before_window, window], dim=1)
