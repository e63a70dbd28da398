"""Gated softmax / sigmoid attention over SGLang's paged KV, with learned-gate eviction.

The attention of the learned sigmoid-gate eviction family (``models/gated.py``; Li, arXiv
2608.23296, Sec. 2.2-2.3 and 2.5). For a query at absolute position i and a cached key j with the
previous layer's gate g_j:

  z_ij = scaling * q_i . k_j + log(g_j + eps),     v_j <- g_j v_j          (the gate's two channels)
  softmax:  A_ij = softmax_j(z_ij)
  sigmoid:  A_ij = sigmoid(z_ij + b(i)),  b(i) = -log(i + 1)

Eviction (Sec. 2.5, "physical eviction"): a row with threshold ``tau > 0`` does not read keys
with g_j < tau, except the query's own key: an entry written by a decode step is used by that step
and deleted after it, as in the authors' evaluation. The prefill reads every key (entries are
deleted after it), so extend batches pass ``tau = 0``. Layer 0 has no gate (``key_gate`` None) and
keeps every key.

Shapes: q [N, Hq, D], the batch's query tokens row after row (``q_lens`` per row, the last ones
of each row: row b's queries are its keys ``seq_len - q_len ..  seq_len - 1``); k_cache [P, Hkv, D],
v_cache [P, Hkv, Dv]; key_gate [P] or None (the gate of each pool slot's token, from the previous
layer); req_to_token [R, M]; rows, seq_lens, q_lens, tau [B]; q_positions [N] absolute positions
(the sigmoid bias). Returns [N, Hq, Dv] in q's dtype; math in float32. ``folded`` (``FoldedKeys``):
rows whose older entries were re-folded into other cells read those instead of a row interval.
``key_keep`` (batch index -> [Hkv, seq_len] bool): the keys each KV head of that row reads, on top of
causality (per-head eviction during decode: ``h2o``, ``keydiff``). ``weight_sums`` (batch index ->
None, filled in place): that row's attention weights summed over its queries and each KV head's
query group, [Hkv, seq_len] float32 (what H2O accumulates).

``gated_attention`` dispatches to the Triton kernel on CUDA (and under TRITON_INTERPRET=1 when
asked for) and to the torch reference elsewhere; the reference is the source of truth. Batches
with per-head keep masks or weight sums (the per-head decode baselines) run on the reference. FlashInfer's
custom attention variants could express the sigmoid form; that seam is left to a GPU session.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.dispatch import choose, run
from sglang_kvx.ops.gated_layout import KINDS, FoldedKeys

__all__ = ["KINDS", "FoldedKeys", "gated_attention", "gated_attention_reference"]


def gated_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_gate: torch.Tensor | None,
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    q_positions: torch.Tensor, tau: torch.Tensor, kind: str, scaling: float, gate_eps: float = 1e-8,
    folded: FoldedKeys | None = None, key_keep: dict[int, torch.Tensor] | None = None,
    weight_sums: dict[int, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"attention kind must be one of {KINDS}, got {kind!r}")
    num_heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // kv_heads
    out = q.new_empty((q.shape[0], num_heads, v_cache.shape[-1]))
    start = 0
    for b in range(rows.numel()):
        n, length = int(q_lens[b]), int(seq_lens[b])
        if n == 0:
            continue
        key_index = torch.arange(length, device=q.device)
        if folded is not None:  # row cells [hidden_from, hidden_to) are gone; their kept keys are extra cells
            start_hidden, end_hidden = int(folded.hidden_from[b]), int(folded.hidden_to[b])
            key_index = torch.cat([key_index[:start_hidden], key_index[end_hidden:]])
        slots = req_to_token[int(rows[b]), key_index].to(torch.long)
        keys = k_cache[slots].float()
        values = v_cache[slots].float()
        g = key_gate[slots].float() if key_gate is not None else None
        if folded is not None:
            lo, hi = int(folded.indptr[b]), int(folded.indptr[b + 1])
            keys = torch.cat([folded.keys[lo:hi].float(), keys])
            values = torch.cat([folded.values[lo:hi].float(), values])
            if g is not None:
                g = torch.cat([folded.gates[lo:hi].float(), g])
            # Extra cells sit before every query of the row (index -1: always causal, never a query's own).
            key_index = torch.cat([torch.full((hi - lo,), -1, device=q.device), key_index])
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[start : start + n].float()
        z = torch.einsum("nhd,lhd->hnl", queries, keys) * scaling
        query_index = length - n + torch.arange(n, device=q.device)
        visible = key_index[None, :] <= query_index[:, None]  # [n, L] causal
        if g is not None:
            z = z + torch.log(g + gate_eps)
            values = values * g[:, None, None]
            threshold = float(tau[b])
            if threshold > 0:
                visible &= (g[None, :] >= threshold) | (key_index[None, :] == query_index[:, None])
        per_head = (key_keep is not None and b in key_keep) or (weight_sums is not None and b in weight_sums)
        if per_head and keys.shape[0] != length:
            raise NotImplementedError("gated attention: per-head keep masks or weight sums on a re-folded row")
        if key_keep is not None and b in key_keep:
            visible = visible[None] & key_keep[b].to(q.device).repeat_interleave(group, dim=0)[:, None, :]  # [Hq, n, L]
        if kind == "softmax":
            a = torch.softmax(z.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        else:
            bias = -torch.log(q_positions[start : start + n].float() + 1.0)
            a = torch.sigmoid(z + bias[None, :, None]) * visible
        if weight_sums is not None and b in weight_sums:
            weight_sums[b] = a.sum(1).view(kv_heads, group, length).sum(1)
        out[start : start + n] = torch.einsum("hnl,lhd->nhd", a, values).to(q.dtype)
        start += n
    return out


def gated_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_gate: torch.Tensor | None,
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
    q_positions: torch.Tensor, tau: torch.Tensor, kind: str, scaling: float, gate_eps: float = 1e-8,
    folded: FoldedKeys | None = None, impl: str | None = None, key_keep: dict[int, torch.Tensor] | None = None,
    weight_sums: dict[int, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Dispatch (``ops/dispatch.py``, op ``gated_attention``): Triton on CUDA, the reference elsewhere
    and for rows with per-head keep masks or weight sums, which the Triton kernel takes neither of yet."""
    per_head = bool(key_keep) or bool(weight_sums)

    def supports(name: str) -> str | None:
        return "rows without per-head keep masks or weight sums" if name == "triton" and per_head else None

    def triton(*args, folded=None, key_keep=None, weight_sums=None):
        from sglang_kvx.ops.triton_gated_attention import gated_attention_triton

        return gated_attention_triton(*args, folded=folded)  # per-head rows never choose it (supports)

    return run("gated_attention", impl, choose("gated_attention", impl, q.device, supports), gated_attention_reference,
               {"triton": triton}, q, k_cache, v_cache, key_gate, req_to_token, rows, seq_lens, q_lens, q_positions,
               tau, kind, scaling, gate_eps, folded=folded, key_keep=key_keep, weight_sums=weight_sums)
