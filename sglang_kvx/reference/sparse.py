"""The block-sparse attention rule in transformers: the oracle for ``--kvx-sparse-attention``.

Written from the rule, independently of ``ops/block_sparse.py``: a query at position p sees the
four-token blocks 0 .. p // 4 (block b holds positions 4b .. 4b + 3); when more of them than the
budget exist it keeps block 0, its own block, and the others whose mean key scores highest, the
score being the sum over the KV head's query group of scaling * q . mean(k); it then attends,
with an ordinary softmax, to the positions of those blocks up to p. Plain loops over queries
and heads, through an attention function registered in transformers' AttentionInterface.
"""

from __future__ import annotations

import torch

from sglang_kvx.reference.hf import HFReference, greedy_steps, take_greedy

SPARSE_ATTENTION = "kvx_block_sparse_oracle"
BLOCK = 4


def _sparse_rule(budget_blocks: int):
    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        _, q_heads, q_len, _ = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        out = torch.empty_like(query, dtype=torch.float32)
        for i in range(q_len):
            p = k_len - q_len + i
            own = p // BLOCK
            for h in range(kv_heads):
                heads = range(h * group, (h + 1) * group)
                if own + 1 <= budget_blocks:
                    chosen = list(range(own + 1))
                else:
                    summed = sum(query[0, g, i].float() for g in heads)
                    others = {b: float(summed @ key[0, h, BLOCK * b : BLOCK * b + BLOCK].float().mean(0)) * scaling
                              for b in range(1, own)}
                    best = sorted(others, key=others.get, reverse=True)[: budget_blocks - 2]
                    chosen = [0, own, *best]
                positions = [j for b in chosen for j in range(BLOCK * b, BLOCK * b + BLOCK) if j <= p]
                k = key[0, h, positions].float()
                v = value[0, h, positions].float()
                for g in heads:
                    weights = torch.softmax(k @ query[0, g, i].float() * scaling, dim=0)
                    out[0, g, i] = weights @ v
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


@torch.no_grad()
def sparse_greedy(reference: HFReference, input_ids: list[int], max_new_tokens: int,
                  budget_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy generation with every attention layer under the rule (prefill and decode steps)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SPARSE_ATTENTION, _sparse_rule(budget_tokens // BLOCK))
    model = reference.model
    previous = model.config._attn_implementation
    model.set_attn_implementation(SPARSE_ATTENTION)
    tokens: list[int] = []
    logprobs: list[float] = []
    try:
        out = model(torch.tensor([input_ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
        for _ in greedy_steps(max_new_tokens, False, "HF sparse oracle"):
            if take_greedy(logits, tokens, logprobs) == max_new_tokens:
                break
            position = torch.tensor([[len(input_ids) + len(tokens) - 1]])
            logits = model(torch.tensor([tokens[-1:]]), position_ids=position, cache_position=position[0],
                           past_key_values=cache, use_cache=True).logits[0, -1]
        return tokens, logprobs
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def sparse_compacted_generate(reference: HFReference, context_ids: list[int], keep: list[torch.Tensor],
                              question_ids: list[int], max_new_tokens: int,
                              budget_tokens: int) -> tuple[list[int], list[float]]:
    """A child of a compacted context under the rule: the context prefilled under it, each attention
    layer's cache cut to ``keep`` (positions per KV head, ascending), then the question answered
    greedily; the rule counts a layer's keys in cache order (kept entries, then the new tokens),
    so the kept entries form new four-token blocks."""
    from transformers import AttentionInterface

    AttentionInterface.register(SPARSE_ATTENTION, _sparse_rule(budget_tokens // BLOCK))
    model = reference.model
    previous = model.config._attn_implementation
    model.set_attn_implementation(SPARSE_ATTENTION)
    try:
        return reference.compacted_generate(context_ids, keep, question_ids, max_new_tokens, attention=SPARSE_ATTENTION)
    finally:
        model.set_attn_implementation(previous)
