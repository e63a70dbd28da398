"""What a scheduler's runtime reports: the figures of ``/kvx/stats`` and ``/metrics`` (numbers only,
cheap for every scrape) and the full ``/kvx/stats`` (stored contexts, running decode steps' reports,
keep-sets). Each decode step's figures come from its own declaration (``DecodeStep.totals``, its row
state's ``report``), so nothing here names a step."""

from __future__ import annotations

from typing import Any

from sglang_kvx.ops.block_layout import BLOCK
from sglang_kvx.serve.plans import WAIT_PASSES, WAIT_REPEAT


def runtime_counts(runtime) -> dict[str, Any]:
    """The runtime's figures (numbers only: cheap enough for every scrape)."""
    return {
        "store_slots": runtime.store.slots_held(),
        "compactions_done": runtime.store.added,
        "bytes_freed": runtime.store.entries_freed * runtime.pool.bytes_per_entry * runtime.pool.num_layers,
        "store_reserved_slots": runtime.admission.eviction.reserved_slots(),
        "compactions_skipped_no_room": runtime.parents.skipped_no_room,
        "compactions_skipped_empty": runtime.parents.degenerate,
        "compactions_skipped_keeps_all": runtime.parents.skipped_keeps_all,
        # Parents whose recording missed layers (a forward ran without the plugin's hooks): left uncompacted.
        "compactions_failed_incomplete_recording": runtime.parents.incomplete_recordings,
        "compactions_failed": runtime.failures,
        "contexts_evicted": runtime.admission.eviction.evicted,
        "evictions_for_round_budget": runtime.admission.eviction.evicted_for_budget,
        "evictions_refused_reserved": runtime.admission.eviction.refused,
        "second_passes_pending": len(runtime.second_pass.jobs),
        "children_waited_for_second_passes": runtime.admission.children_waited[WAIT_PASSES],
        "children_waited_for_repeated_beginnings": runtime.admission.children_waited[WAIT_REPEAT],
        "decode_rows": len(runtime.decode.rows),
        "decode_slots_freed": runtime.decode.freed_slots,
        "decode_reruns": runtime.decode.rerun_count,  # rows re-run
        "decode_rerun_forwards": runtime.decode.rerun_forwards,
        "decode_partial_reruns": runtime.decode.partial_reruns,  # forwards re-running only some rows of a batch
        "decode_step_failures": runtime.decode.failures,
        # Each decode step's own figures (its ``totals``: ODA's routing, learned-gate deletions, per-head evictions).
        **{name: value for name, value in runtime.decode.totals.items() if isinstance(value, (int, float))},
        "sparse_index_blocks_built": runtime.sparse_index.blocks_built,  # compressed keys built (not reused)
        "shared_prefixes_seen": runtime.auto.shared.seen,  # plain requests repeating an unmarked long beginning
        "auto_contexts_queued": runtime.auto.queued,
        # Per tier: the pool's compacted contexts, then host memory's (--kvx-host-store-gb) and the disk's
        # (--kvx-context-dir) with their restores; the disk's files written and refused.
        "pool_contexts": len(runtime.store),
        "pool_context_bytes": runtime.store.slots_held() * runtime.pool.bytes_per_entry * runtime.pool.num_layers,
        **runtime.admission.eviction.tiering.counts(),
    }


def _with_sparse_index(runtime, summary: dict[str, Any], context) -> dict[str, Any]:
    """Under --kvx-sparse-attention: the indexer's blocks per attention layer and KV head for the
    whole context and for what each layer kept, regrouped into new blocks (QSA)."""
    if not runtime.config.sparse_budget:
        return summary
    n = len(context.context_ids)
    return {**summary, "sparse_index_blocks": {"full_context": -(-n // BLOCK),
                                               "regrouped_per_layer": [-(-k // BLOCK) for k in context.kept_per_layer]}}


def runtime_stats(runtime) -> dict[str, Any]:
    """``/kvx/stats``: the figures, the stored contexts and the running decode steps' reports."""
    contexts = list(runtime.store.contexts.values())
    return {
        "compacted_contexts": [_with_sparse_index(runtime, c.summary(), c) for c in contexts],
        **runtime_counts(runtime),
        "last_compaction_error": runtime.errors[-1] if runtime.errors else None,
        "host_compacted_contexts": runtime.admission.eviction.tiering.host.summaries(),
        "disk_tier": runtime.admission.eviction.tiering.disk_report(),
        "last_restore_failure": runtime.admission.eviction.tiering.last_restore_failure,
        # Running requests by their decode step's report (ODA's routing, learned-gate deletions, per-head live entries).
        **runtime.decode.reports(),
        # Each decode step's per-layer figures (learned-gate eviction: entries deleted after the prefill and during decode).
        **{name: value for name, value in runtime.decode.totals.items() if not isinstance(value, (int, float))},
        "last_decode_step_error": runtime.decode.last_error,
        # Served by /kvx/keep_sets only (large): what each context keeps, per layer and KV head.
        "keep_sets": [{**c.summary(), "positions": c.keep_positions_lists} for c in contexts],
    }
