"""GateSight's training target: how much the attention layer's output moves when one entry goes.

For continuation query t (a token after the context) and context entry j of KV head k, removing j
from the softmax of every query head h in k's group changes head h's output by
    o_th - o'_th = a_thj (v_j - o_th) / (1 - a_thj)
(renormalising the remaining weights), and the layer output W_o [.. o_th ..] by W_o applied to
those per-head changes (the output gate is omitted: seed 000, appendix B). The utility of j is
the max of that change's norm over the continuation tokens, max-normalised per document, layer
and KV head, computed in float32. ``brute_force_change`` recomputes the same quantity by deleting
the key outright; the closed form must agree with it (the paper: within 1.4e-5).
"""

from __future__ import annotations

import torch


def _attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query_position: int, scaling: float):
    """Causal attention of queries at positions first_query_position + t over keys/values [Hkv, S, D]
    -> (probs [Hq, T, S], outputs [Hq, T, D]), float32."""
    num_q_heads, num_queries, _ = queries.shape
    group = num_q_heads // keys.shape[0]
    k = keys.float().repeat_interleave(group, dim=0)
    v = values.float().repeat_interleave(group, dim=0)
    logits = queries.float() @ k.transpose(1, 2) * scaling
    position = first_query_position + torch.arange(num_queries, device=queries.device)
    future = torch.arange(keys.shape[1], device=queries.device)[None, :] > position[:, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return probs, probs @ v


def leave_one_out_change(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor, n_context: int, scaling: float
) -> torch.Tensor:
    """Closed form: ||change of the layer output|| [Hkv, T, n_context] for every continuation query and context entry.

    queries [Hq, T, D] of the T tokens after the context (positions n_context .. n_context+T-1, after RoPE),
    keys / values [Hkv, n_context + T, D] (after RoPE, as cached), o_proj [hidden, Hq * D].
    """
    num_q_heads, num_queries, head_dim = queries.shape
    num_kv_heads = keys.shape[0]
    group = num_q_heads // num_kv_heads
    probs, outputs = _attention(queries, keys, values, n_context, scaling)
    a = probs[:, :, :n_context]  # [Hq, T, n]
    v = values[:, :n_context].float()  # [Hkv, n, D]
    w_o = o_proj.float().reshape(o_proj.shape[0], num_q_heads, head_dim)  # [hidden, Hq, D]
    change = torch.empty(num_kv_heads, num_queries, n_context, device=queries.device)
    for kv_head in range(num_kv_heads):
        heads = range(kv_head * group, (kv_head + 1) * group)
        total = 0
        for h in heads:
            # a/(1-a) (v_j - o_t), mapped through head h's columns of W_o: W_o v_j - W_o o_t.
            projected_v = v[kv_head] @ w_o[:, h].T  # [n, hidden]
            projected_o = outputs[h] @ w_o[:, h].T  # [T, hidden]
            weight = a[h] / (1 - a[h]).clamp_min(1e-12)  # [T, n]
            total = total + weight[:, :, None] * (projected_v[None] - projected_o[:, None])  # [T, n, hidden]
        change[kv_head] = total.norm(dim=-1)
    return change


def brute_force_change(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_proj: torch.Tensor, n_context: int, scaling: float,
    kv_head: int, entry: int,
) -> torch.Tensor:
    """[T]: ||W_o (o - o_without_entry)|| with key ``entry`` of ``kv_head`` deleted from the cache."""
    num_q_heads, _, head_dim = queries.shape
    _, full = _attention(queries, keys, values, n_context, scaling)
    keep = torch.ones(keys.shape[1], dtype=torch.bool, device=keys.device)
    keep[entry] = False
    group = num_q_heads // keys.shape[0]
    heads = list(range(kv_head * group, (kv_head + 1) * group))
    w_o = o_proj.float().reshape(o_proj.shape[0], num_q_heads, head_dim)
    diff = 0
    for h in heads:
        # Head h alone over its KV head's cache without the entry (positions keep their RoPE).
        k = keys[kv_head : kv_head + 1, keep]
        v = values[kv_head : kv_head + 1, keep]
        q = queries[h : h + 1]
        # The deleted entry shifts later indices by one; compare against positions, not indices.
        positions = torch.arange(keys.shape[1], device=keys.device)[keep]
        logits = (q.float() @ k.float().transpose(1, 2))[0] * scaling  # [T, S-1]
        query_position = n_context + torch.arange(q.shape[1], device=keys.device)
        logits = logits.masked_fill(positions[None, :] > query_position[:, None], float("-inf"))
        without = logits.softmax(dim=-1) @ v[0].float()  # [T, D]
        diff = diff + (full[h] - without) @ w_o[:, h].T  # [T, hidden]
    return diff.norm(dim=-1)


def utility_labels(changes: list[torch.Tensor]) -> torch.Tensor:
    """Max over every continuation query (of every continuation) -> max-normalised utility [Hkv, n].

    ``changes``: leave_one_out_change outputs [Hkv, T_i, n] for the continuations of one document.
    """
    utility = torch.stack([c.amax(dim=1) for c in changes]).amax(dim=0)  # [Hkv, n]
    return utility / utility.amax(dim=1, keepdim=True).clamp_min(1e-30)
