"""Eviction rules of the learned-gate paper's protocol, in the transformers model (the oracle).

Each rule is a ``keep_fn`` for ``KvxGatedForCausalLM`` (``models/gated.py``): given one layer's
normed, rotated queries and keys [B, H, T, D] and the gate that layer receives, it returns which
keys each query reads. Queries before ``prefill_len`` are the prefill and read every earlier key;
each later query is one decode step, run in the same forward (attention is causal, so a single
forward equals step-by-step decoding with the rule applied after every step). Written from the
paper (Li, arXiv 2608.23296, Sec. 2.5), independently of the server's op:

* ``gate_rule``: learned-gate eviction -- entries with g < tau are deleted after the prefill, and a
  decode step's own entry after the step that wrote it (layer 0 has no gate and keeps all);
* ``window_rule``: attention sinks plus a recent window at decode time (StreamingLLM, Xiao et al.
  2024) -- a decode step with t keys reads the first ``sinks`` and the last ``window`` of them;
* ``h2o_rule``: online H2O on a dense backbone (Zhang et al. 2023) -- per layer and head a budget of
  entries, half the most recent, half the heavy hitters by attention accumulated since the prefill;
* ``keydiff_rule``: online KeyDiff (Park et al. 2025) -- per layer and head keep the budget of keys
  least cosine-similar to the anchor, the mean of the cached keys;
* ``random_rule``: the random support-removal probe -- each prefill entry is deleted with
  probability ``rate``, per layer and head.

``live_entries`` counts what a rule leaves cached after the last step (the matched-cache size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sglang_kvx.models.gated import KeepFn


def _decode_rows(t: int, prefill_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.arange(t, device=device)
    return index, index >= prefill_len


def gate_rule(tau: float, prefill_len: int) -> KeepFn:
    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor | None:
        if gate is None or tau <= 0:
            return None
        index, decoding = _decode_rows(k.shape[2], prefill_len, k.device)
        kept = gate[:, None, :] >= tau  # [B, 1, Tk]
        own = index[None, :] == index[:, None]  # [Tq, Tk]
        return (~decoding[:, None] | own)[None] | kept
    return keep


def window_rule(sinks: int, window: int, prefill_len: int) -> KeepFn:
    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        index, decoding = _decode_rows(k.shape[2], prefill_len, k.device)
        # Query i is the step with i + 1 keys: it reads keys j < sinks and j > i - window.
        read = (index[None, :] < sinks) | (index[None, :] > index[:, None] - window)
        return (~decoding[:, None] | read)[None]
    return keep


def _attention_row(z: torch.Tensor, visible: torch.Tensor, kind: str, position: int) -> torch.Tensor:
    """One query's attention weights [H, Tk] over its visible keys (logits z [H, Tk])."""
    if kind == "softmax":
        return torch.softmax(z.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.sigmoid(z - math.log(position + 1.0)) * visible


def h2o_rule(budget: int, prefill_len: int, kind: str) -> KeepFn:
    """Online H2O with ``budget`` entries per head: ``budget // 2`` recent, the rest heavy hitters."""
    recent = budget // 2

    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            raise ValueError("H2O runs on the dense (no-gate) backbone")
        b, h, t, d = k.shape
        out = torch.ones((b, h, t, t), dtype=torch.bool, device=k.device)
        index = torch.arange(t, device=k.device)
        for batch in range(b):
            z = q[batch] @ k[batch].transpose(-1, -2) / math.sqrt(d)  # [H, Tq, Tk]
            causal = index[None, :] <= index[:, None]
            if kind == "softmax":
                prefill_a = torch.softmax(z[:, :prefill_len, :prefill_len].masked_fill(~causal[:prefill_len, :prefill_len], float("-inf")), -1)
            else:
                bias = -torch.log(index[:prefill_len].float() + 1.0)[None, :, None]
                prefill_a = torch.sigmoid(z[:, :prefill_len, :prefill_len] + bias) * causal[:prefill_len, :prefill_len]
            score = torch.zeros((h, t), device=k.device)
            score[:, :prefill_len] = prefill_a.sum(1)
            kept = torch.zeros((h, t), dtype=torch.bool, device=k.device)
            if budget >= prefill_len:
                kept[:, :prefill_len] = True
            else:
                kept[:, prefill_len - recent : prefill_len] = True
                heavy = score[:, : prefill_len - recent].topk(budget - recent, dim=-1).indices
                kept.scatter_(1, heavy, True)
            for i in range(prefill_len, t):
                visible = kept.clone()
                visible[:, i] = True
                out[batch, :, i] = visible
                score += _attention_row(z[:, i], visible, kind, i)
                kept[:, i] = True
                if int(kept[0].sum()) > budget:  # every head holds the same count
                    old = kept.clone()
                    old[:, max(i + 1 - recent, 0) : i + 1] = False  # the recent half is never evicted
                    victim = score.masked_fill(~old, float("inf")).argmin(dim=-1)
                    kept[torch.arange(h), victim] = False
        return out
    return keep


def keydiff_rule(budget: int, prefill_len: int) -> KeepFn:
    """Online KeyDiff with ``budget`` entries per head: evict the key most similar to the mean key."""

    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            raise ValueError("KeyDiff runs on the dense (no-gate) backbone")
        b, h, t, _ = k.shape
        out = torch.ones((b, h, t, t), dtype=torch.bool, device=k.device)
        for batch in range(b):
            keys = k[batch].float()  # [H, T, D]
            kept = torch.zeros((h, t), dtype=torch.bool, device=k.device)
            if budget >= prefill_len:
                kept[:, :prefill_len] = True
            else:
                anchor = keys[:, :prefill_len].mean(1, keepdim=True)
                similarity = F.cosine_similarity(keys[:, :prefill_len], anchor, dim=-1)
                kept.scatter_(1, similarity.topk(budget, dim=-1, largest=False).indices, True)
            for i in range(prefill_len, t):
                visible = kept.clone()
                visible[:, i] = True
                out[batch, :, i] = visible
                kept[:, i] = True
                if int(kept[0].sum()) > budget:
                    anchor = (keys * kept[..., None]).sum(1, keepdim=True) / kept.sum(1)[:, None, None]
                    similarity = F.cosine_similarity(keys, anchor, dim=-1).masked_fill(~kept, float("-inf"))
                    kept[torch.arange(h), similarity.argmax(dim=-1)] = False
        return out
    return keep


def random_rule(rate: float, prefill_len: int, seed: int) -> KeepFn:
    """Delete each prefill entry with probability ``rate`` (per head) before the decode steps."""
    generator = torch.Generator().manual_seed(seed)

    def keep(q: torch.Tensor, k: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        b, h, t, _ = k.shape
        kept = torch.rand((b, h, 1, t), generator=generator) >= rate
        kept[..., prefill_len:] = True
        index, decoding = _decode_rows(t, prefill_len, k.device)
        return kept.to(k.device) | ~decoding[None, None, :, None]
    return keep


def live_entries(gates: tuple[torch.Tensor, ...], tau: float, cached: int) -> int:
    """Entries a gated model keeps of ``cached`` positions at threshold ``tau``, over all layers
    (layer 0 keeps all; layer l + 1 keeps the positions whose gate g^(l) >= tau)."""
    return cached + sum(int((g[0, :cached] >= tau).sum()) for g in gates)
