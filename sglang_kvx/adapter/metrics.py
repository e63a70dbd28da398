"""The extension's figures on SGLang's own Prometheus ``/metrics`` (with ``--enable-metrics``).

SGLang's scheduler writes its metrics with ``prometheus_client`` in multiprocess mode; the HTTP
server's ``/metrics`` gathers every process's. These live beside them, in the scheduler process,
named ``sglang:kvx_*`` with SGLang's labels. They are brought up to date from the runtime's own
counters whenever a request is released and after ``/flush_cache`` (what changes the store happens
then), so a scrape sees them as of the last finished request.
"""

from __future__ import annotations

from typing import Any

# Runtime stats key -> counter name (monotonic: each sync adds what grew since the last).
COUNTERS = {
    "compactions_done": ("sglang:kvx_compactions_total", "Contexts compacted and stored."),
    "compactions_failed": ("sglang:kvx_compactions_failed_total", "Compactions that failed inside the server (the context stays uncompacted)."),
    "compactions_skipped_no_room": ("sglang:kvx_compactions_skipped_no_room_total", "Parents left uncompacted for lack of room."),
    "compactions_skipped_empty": ("sglang:kvx_compactions_skipped_empty_total", "Parents whose settings keep no entry."),
    "compactions_skipped_keeps_all": ("sglang:kvx_compactions_skipped_keeps_all_total",
                                      "Parents whose kept entries, in whole pages, would fill the whole context."),
    "contexts_evicted": ("sglang:kvx_contexts_evicted_total", "Compacted contexts evicted to make room."),
    "children_waited_for_second_passes": ("sglang:kvx_children_waited_for_second_passes_total",
                                          "Children queued until their context's second passes ended."),
    "children_waited_for_repeated_beginnings": ("sglang:kvx_children_waited_for_repeated_beginnings_total",
                                                "Plain requests queued until the beginning they repeat was compacted."),
    "bytes_freed": ("sglang:kvx_bytes_freed_total", "KV bytes compaction gave back to the pool (all attention layers)."),
    "host_contexts_stored": ("sglang:kvx_host_contexts_stored_total", "Compacted contexts the pool evicted into host memory."),
    "host_contexts_dropped": ("sglang:kvx_host_contexts_dropped_total", "Contexts host memory let go for room (or could not hold)."),
    "host_restores": ("sglang:kvx_host_restores_total", "Contexts copied back from host memory into the pool for a child."),
    "host_restore_seconds": ("sglang:kvx_host_restore_seconds_total", "Seconds spent copying contexts back from host memory."),
    "disk_contexts_stored": ("sglang:kvx_disk_contexts_stored_total", "Compacted contexts evicted into the disk tier."),
    "disk_contexts_dropped": ("sglang:kvx_disk_contexts_dropped_total", "Context files the disk tier removed for room (or could not hold)."),
    "disk_restores": ("sglang:kvx_disk_restores_total", "Contexts read back from disk into the pool for a child."),
    "disk_restore_seconds": ("sglang:kvx_disk_restore_seconds_total", "Seconds spent reading contexts back from disk."),
    "disk_files_written": ("sglang:kvx_disk_files_written_total", "Context files written (evicted or persisted contexts)."),
    "disk_write_failures": ("sglang:kvx_disk_write_failures_total", "Context writes that failed (full disk, unwritable directory)."),
    "disk_files_refused": ("sglang:kvx_disk_files_refused_total", "Context files refused (torn, corrupted, hostile, another model's)."),
    "restore_failures": ("sglang:kvx_restore_failures_total", "Children served by a full prefill: their context could not come back from a tier."),
    "oda_routed_steps": ("sglang:kvx_oda_routed_steps_total", "Decode steps On-Demand Attention routed."),
    "oda_full_steps": ("sglang:kvx_oda_full_steps_total", "Routed steps re-run with Full attention."),
}
GAUGES = {
    "store_slots": ("sglang:kvx_store_slots", "KV pool slots held by compacted contexts."),
    "store_reserved_slots": ("sglang:kvx_store_reserved_slots", "Store slots within the tenants' reserved shares."),
    "pool_context_bytes": ("sglang:kvx_pool_context_bytes", "KV bytes of the compacted contexts in the pool."),
    "host_contexts": ("sglang:kvx_host_contexts", "Compacted contexts held in host memory."),
    "host_bytes": ("sglang:kvx_host_bytes", "Bytes of the compacted contexts held in host memory."),
    "disk_contexts": ("sglang:kvx_disk_contexts", "This model's compacted contexts in the disk tier's directory."),
    "disk_bytes": ("sglang:kvx_disk_bytes", "Bytes of this model's context files in the disk tier's directory."),
    "disk_writes_queued": ("sglang:kvx_disk_writes_queued", "Context writes queued for the disk tier's worker thread."),
    "disk_reads_queued": ("sglang:kvx_disk_reads_queued", "Context reads queued for the disk tier's worker (children waiting)."),
    "second_passes_pending": ("sglang:kvx_second_passes_pending", "Second passes (KVzip's reconstruction) not yet run."),
}
SCORING = ("sglang:kvx_scoring_seconds", "Time to score, allocate and select one context's keep-set.")
SCORING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KvxMetrics:
    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)
        self.labels = labels
        self.counters = {key: Counter(name=name, documentation=doc, labelnames=names) for key, (name, doc) in COUNTERS.items()}
        self.gauges = {key: Gauge(name=name, documentation=doc, labelnames=names, multiprocess_mode="mostrecent")
                       for key, (name, doc) in GAUGES.items()}
        self.contexts = Gauge(name="sglang:kvx_compacted_contexts", documentation="Compacted contexts in the store.",
                              labelnames=names, multiprocess_mode="mostrecent")
        self.scoring = Histogram(name=SCORING[0], documentation=SCORING[1], labelnames=names, buckets=SCORING_BUCKETS)
        for counter in self.counters.values():
            counter.labels(**labels)  # shown from the start, at 0
        self._synced: dict[str, float] = {key: 0 for key in COUNTERS}
        self._scored: set[int] = set()  # contexts whose scoring time was observed

    def sync(self, runtime: Any) -> None:
        stats = runtime.counts()
        for key, counter in self.counters.items():
            grown = stats[key] - self._synced[key]
            if grown > 0:
                counter.labels(**self.labels).inc(grown)
            self._synced[key] = stats[key]
        for key, gauge in self.gauges.items():
            gauge.labels(**self.labels).set(stats[key])
        contexts = list(runtime.store.contexts.values())
        self.contexts.labels(**self.labels).set(len(contexts))
        for context in contexts:
            if id(context) not in self._scored:
                self._scored.add(id(context))
                self.scoring.labels(**self.labels).observe(context.timings.get("score_select_s", 0.0))
        self._scored &= {id(c) for c in contexts}
