"""Compaction ops, torch reference (the source of truth; runs on any device).

Shapes: heads first, then entries.
    scores: [H, n]   kv (keys or values of one layer): [H, n, D]   keep: [H, K] (positions, ascending)
    attention outputs: [T, H, D] with their log-sum-exp [T, H] (tokens first, as in SGLang).
"""

from __future__ import annotations

import torch


def topk_per_head(scores: torch.Tensor, k: int, protected: int) -> torch.Tensor:
    """Per head: positions [0, protected) plus the k best-scoring of the rest, sorted ascending.

    Returns a LongTensor [H, protected + k']; k' = min(k, n - protected) (a budget larger than what
    is left keeps everything). Ties go to the later position: recent context is the safer keep
    under every policy here, and a stable sort makes the choice the same on every device.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [heads, n], got shape {tuple(scores.shape)}")
    num_heads, n = scores.shape
    if not 0 <= protected <= n:
        raise ValueError(f"protected prefix of {protected} entries does not fit a context of {n} entries")
    if k < 0:
        raise ValueError(f"budget k must be >= 0, got {k}")
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN; a policy must give every entry a number")
    k = min(k, n - protected)
    prefix = torch.arange(protected, device=scores.device).expand(num_heads, protected)
    candidates = scores[:, protected:]
    if k == 0:
        return prefix.clone()
    # No full sort: the k-th best score per head (topk is linear time), every entry above it, and
    # of the entries tied with it the newest ones, as many as the budget has left.
    kth = candidates.topk(k, dim=-1).values[:, -1:]
    above = candidates > kth
    tied = candidates == kth
    ties_wanted = k - above.sum(dim=-1, keepdim=True)
    ties_from_end = tied.flip(-1).cumsum(dim=-1).flip(-1)  # tied entries at this position or later
    take = above | (tied & (ties_from_end <= ties_wanted))
    chosen = take.nonzero()[:, 1].view(num_heads, k) + protected  # row-major: ascending per head
    return torch.cat([prefix, chosen], dim=-1)


def compact_gather(kv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Gather each head's kept entries: kv [H, n, D], keep [H, K] -> [H, K, D] (a dense prefix per head)."""
    if kv.dim() != 3 or keep.dim() != 2 or keep.shape[0] != kv.shape[0]:
        raise ValueError(f"need kv [H, n, D] and keep [H, K]; got {tuple(kv.shape)} and {tuple(keep.shape)}")
    if keep.numel() and (keep.min() < 0 or keep.max() >= kv.shape[1]):
        raise ValueError(f"keep positions must lie in [0, {kv.shape[1]})")
    index = keep.to(device=kv.device, dtype=torch.long)[..., None].expand(-1, -1, kv.shape[-1])
    return torch.gather(kv, 1, index)


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over two disjoint key sets A and B into attention over A ∪ B.

    Convention: lse is the NATURAL log of the softmax denominator, lse = log sum_j exp(s_j) over the
    part's scaled logits s_j = q.k_j * scale; o is that part's softmax-weighted sum of values.
    (FlashInfer's merge_state uses log2; convert with lse_2 = lse / ln 2 before calling it.)
    Then o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}) and lse = logaddexp(lse_a, lse_b).
    An empty part has lse = -inf and contributes nothing; if both are empty o is 0.
    Shapes: o [T, H, D], lse [T, H]. Math in float32; o returns in o_a's dtype, lse in float32.
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"need o_a, o_b [T, H, D] and lse_a, lse_b [T, H]; got {tuple(o_a.shape)}, {tuple(o_b.shape)}, "
            f"{tuple(lse_a.shape)}, {tuple(lse_b.shape)}"
        )
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # Both parts empty: lse = -inf and the weights would be exp(nan); such a row has no keys at all.
    both_empty = torch.isneginf(lse)
    safe_lse = torch.where(both_empty, torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe_lse)[..., None]
    weight_b = torch.exp(lse_b - safe_lse)[..., None]
    # An empty part's o may be garbage (0/0 from some kernels); weight 0 must mean "not there".
    part_a = torch.where(weight_a > 0, weight_a * o_a.float(), 0.0)
    part_b = torch.where(weight_b > 0, weight_b * o_b.float(), 0.0)
    return (part_a + part_b).to(o_a.dtype), lse
