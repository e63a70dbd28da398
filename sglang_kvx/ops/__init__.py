"""The kernel layer: each op a torch reference (the source of truth, runs on CPU).

``gdn``: Gated-DeltaNet rules, causal conv, gated norm (imported by their users directly).
``compaction``: top-K per head, gather of kept entries, two-part attention merge.
"""

from sglang_kvx.ops.compaction import compact_gather, merge_attention_states, topk_per_head

__all__ = ["compact_gather", "merge_attention_states", "topk_per_head"]
