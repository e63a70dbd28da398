"""The kernel layer: each op a torch reference (the source of truth, runs on CPU).

``gdn``: Gated-DeltaNet rules, causal conv, gated norm (imported by their users directly).
``compaction``: top-K per head, gather of kept entries, two-part attention merge.
``window_attention``: decode attention over sinks + a recent window of the paged KV (ODA's Local
step; imported by its users directly, as re-exporting the function would hide the module).
``state_snapshot``: snapshot / restore of GDN recurrent and conv states for pool slots (ODA's Full retry).
"""

from sglang_kvx.ops.compaction import compact_gather, merge_attention_states, topk_per_head
from sglang_kvx.ops.state_snapshot import restore_states, snapshot_states

__all__ = ["compact_gather", "merge_attention_states", "topk_per_head"]
__all__ += ["restore_states", "snapshot_states"]
