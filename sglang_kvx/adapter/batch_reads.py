"""What each attention layer of a forward batch reads, planned once per batch from the runtime's rows.

``batch_reads_of`` gives a batch's page tables (``serve/page_tables.py``) for backends whose kernel reads
them (``attention.py``), and ``masked_rows_of`` one layer's rows that read other than their whole row for
the masked path (backends without a table reader, scaled caches, the learned-gate backend).
"""

from __future__ import annotations

from sglang_kvx.adapter.cell_space import cell_space_of
from sglang_kvx.adapter.forward import link_of
from sglang_kvx.adapter.graph_replay import on_capture_path
from sglang_kvx.serve.page_tables import BatchReads, build_batch_reads
from sglang_kvx.store import PrefixCells


def masked_rows_of(backend, layer, forward_batch) -> dict[int, PrefixCells]:
    """Batch index -> what that row reads of this layer where it differs from its whole row: a compacted
    prefix's cells, or a decode step's span (sinks and window). Empty for most batches."""
    link = link_of(backend)  # put on every backend of a compacting scheduler (adapter/forward.py)
    if link is None or layer.is_cross_attention or not _may_differ(link, forward_batch):
        return {}
    index = link.runtime.compactor.layer_index.get(layer.layer_id)
    return {} if index is None else _layer_masks(link.runtime, index, link.batch(forward_batch))


def _may_differ(link, forward_batch) -> bool:
    """Whether any row of an eager forward may read other than its whole row. A graph's capture runs on
    dummy rows, and its replay reads the tables the graph captured (``graph_tables.py``), so neither plans here."""
    return _rows_may_differ(link.runtime) and not on_capture_path(forward_batch.req_pool_indices)


def _rows_may_differ(runtime) -> bool:
    # The common case is False: no running row reads a compacted prefix or runs a decode step.
    return bool(runtime.admission.rows.row_context or runtime.decode)


def _layer_masks(runtime, index: int, batch) -> dict[int, PrefixCells]:
    masked = runtime.admission.rows.masked_rows(index, batch)
    if runtime.decode and batch.is_decode:
        # A child running a decode step: its span over this layer's own keys (kept entries, then its tokens).
        contexts = runtime.admission.rows.child_contexts(index, batch)
        masked.update(runtime.decode.masked_rows(index, batch.rows, batch.seq_lens, contexts))
    return masked


def batch_reads_of(backend, forward_batch) -> BatchReads | None:
    """The forward batch's page tables (``serve/page_tables.py``), built once per batch: in the backend's
    ``init_forward_metadata``, or by the first layer that asks where SGLang planned elsewhere. None
    when every row reads its whole row in every layer, and on a graph's capture or replay."""
    link = link_of(backend)
    if link is None or not _may_differ(link, forward_batch):
        return None
    return planned_reads(backend, forward_batch)


def planned_reads(backend, forward_batch) -> BatchReads | None:
    """``batch_reads_of`` for a batch about to replay a graph (planned out of the graph, as SGLang plans a
    replay's metadata): the same tables, cached on the same batch view."""
    link = link_of(backend)
    if link is None or not _rows_may_differ(link.runtime):
        return None
    batch = link.batch(forward_batch)
    return batch.shared("batch_reads", lambda: _build_reads(backend, link, batch))


def _build_reads(backend, link, batch) -> BatchReads | None:
    runtime = link.runtime
    layer_ids = sorted(runtime.compactor.layer_index, key=runtime.compactor.layer_index.get)
    masked = [_layer_masks(runtime, index, batch) for index in range(len(layer_ids))]
    if not any(masked):
        return None
    fb = batch.fb
    req_to_token = backend.req_to_token_pool.req_to_token
    carry = batch.is_decode and fb.rids is not None  # the batch's requests are known: its tables may carry over
    if carry and link.table_carry.holding:  # the last step's tables, one cell longer per list, where the batch allows
        newest = req_to_token[fb.req_pool_indices, fb.seq_lens - 1]
        carried = link.table_carry.advance(masked, batch.rows, fb.rids, batch.seq_lens, newest)
        if carried is not None:
            return carried
    q_lens = None if batch.is_decode else list(fb.extend_seq_lens_cpu)
    reads = build_batch_reads(masked, layer_ids, batch.rows, batch.seq_lens, q_lens, req_to_token,
                              cell_space_of(backend.token_to_kv_pool, layer_ids))
    if carry:
        link.table_carry.keep(reads, masked, batch.rows, fb.rids, batch.seq_lens, layer_ids)
    return reads or None
