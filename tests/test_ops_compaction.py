"""The compaction ops against brute-force references: Python-sorted top-K, indexed loops, softmax over all keys."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kvx.ops.compaction import compact_gather, merge_attention_states, topk_per_head


def brute_force_keep(scores: torch.Tensor, k: int, protected: int) -> list[list[int]]:
    """Per head: the prefix plus the k best of the rest, ties to the later position, ascending."""
    n = scores.shape[1]
    keep = []
    for head_scores in scores.tolist():
        rest = sorted(range(protected, n), key=lambda i: (-head_scores[i], -i))[: max(0, min(k, n - protected))]
        keep.append(sorted(list(range(protected)) + rest))
    return keep


@pytest.mark.parametrize("protected,k", [(0, 0), (0, 5), (3, 4), (3, 17), (3, 100), (20, 0), (20, 3)])
def test_topk_per_head_matches_brute_force(protected, k):
    scores = torch.randn(3, 20, generator=torch.Generator().manual_seed(protected * 31 + k))
    keep = topk_per_head(scores, k, protected)
    assert keep.dtype == torch.long
    assert keep.shape == (3, protected + min(k, 20 - protected))
    assert keep.tolist() == brute_force_keep(scores, k, protected)


def test_topk_ties_go_to_the_later_position():
    scores = torch.zeros(2, 10)
    scores[1, 4] = 1.0
    assert topk_per_head(scores, 3, 0).tolist() == [[7, 8, 9], [4, 8, 9]]
    # The prefix is not a candidate even when every score ties.
    assert topk_per_head(scores, 2, 2).tolist() == [[0, 1, 8, 9], [0, 1, 4, 9]]


def test_topk_keeps_infinite_scores_first():
    scores = torch.tensor([[5.0, float("inf"), -1.0, float("-inf"), 2.0]])
    assert topk_per_head(scores, 2, 0).tolist() == [[0, 1]]
    assert topk_per_head(scores, 4, 0).tolist() == [[0, 1, 2, 4]]


@pytest.mark.parametrize(
    "scores,k,protected,match",
    [
        (torch.zeros(2, 5), 1, 6, "protected prefix of 6 entries does not fit a context of 5"),
        (torch.zeros(2, 5), 1, -1, "protected prefix of -1"),
        (torch.zeros(2, 5), -1, 0, "budget k must be >= 0"),
        (torch.zeros(5), 1, 0, r"scores must be \[heads, n\]"),
        (torch.tensor([[0.0, float("nan")]]), 1, 0, "NaN"),
    ],
)
def test_topk_bad_inputs_raise(scores, k, protected, match):
    with pytest.raises(ValueError, match=match):
        topk_per_head(scores, k, protected)


def test_compact_gather_matches_indexing():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 12, 4, generator=gen)
    keep = torch.stack([torch.randperm(12, generator=gen)[:5].sort().values for _ in range(3)])
    out = compact_gather(kv, keep)
    assert out.shape == (3, 5, 4)
    for head in range(3):
        for slot in range(5):
            assert torch.equal(out[head, slot], kv[head, keep[head, slot]])


def test_compact_gather_bad_inputs_raise():
    kv = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        compact_gather(kv, torch.tensor([[0, 4], [1, 2]]))
    with pytest.raises(ValueError, match=r"need kv \[H, n, D\]"):
        compact_gather(kv, torch.tensor([[0, 1]]))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k/v [S, H, D] -> o [T, H, D], lse [T, H] (natural log of the softmax denominator)."""
    logits = torch.einsum("thd,shd->ths", q, k) * scale
    return torch.einsum("ths,shd->thd", logits.softmax(-1), v), torch.logsumexp(logits, dim=-1)


def test_merge_equals_softmax_over_the_concatenated_keys():
    gen = torch.Generator().manual_seed(1)
    T, H, D = 5, 3, 8
    q = torch.randn(T, H, D, generator=gen) * 3  # large logits: the merge must not overflow
    k_a, v_a = torch.randn(7, H, D, generator=gen), torch.randn(7, H, D, generator=gen)
    k_b, v_b = torch.randn(4, H, D, generator=gen), torch.randn(4, H, D, generator=gen)
    scale = 1 / math.sqrt(D)
    o_a, lse_a = attention(q, k_a, v_a, scale)
    o_b, lse_b = attention(q, k_b, v_b, scale)
    o_ref, lse_ref = attention(q, torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), scale)
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)
    # Order does not matter.
    o_swapped, lse_swapped = merge_attention_states(o_b, lse_b, o_a, lse_a)
    torch.testing.assert_close(o_swapped, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_swapped, lse_ref, atol=1e-5, rtol=1e-5)


def test_merge_with_an_empty_part():
    gen = torch.Generator().manual_seed(2)
    o_a, lse_a = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, generator=gen)
    empty_o, empty_lse = torch.full((2, 3, 4), float("nan")), torch.full((2, 3), float("-inf"))
    o, lse = merge_attention_states(o_a, lse_a, empty_o, empty_lse)
    torch.testing.assert_close(o, o_a)
    torch.testing.assert_close(lse, lse_a)
    o, lse = merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_merge_keeps_the_output_dtype_and_checks_shapes():
    o = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    lse = torch.zeros(2, 3)
    merged, merged_lse = merge_attention_states(o, lse, o, lse)
    assert merged.dtype == torch.bfloat16 and merged_lse.dtype == torch.float32
    torch.testing.assert_close(merged_lse, torch.full((2, 3), math.log(2)))
    with pytest.raises(ValueError, match="need o_a, o_b"):
        merge_attention_states(o, lse, o[:1], lse[:1])
