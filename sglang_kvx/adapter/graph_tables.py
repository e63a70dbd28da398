"""Children of compacted contexts and decode-step rows in captured decode graphs: a page-table graph variant.

A captured graph replays fixed kernels on fixed addresses, and none of the plugin's Python. A decode
batch whose rows read other than their whole rows (children of per-layer, folded or per-head contexts,
decode-step spans) can still replay one where its attention backend's own kernel reads page tables
(``attention.ReadsPageTables``). SGLang's decode runner captures every batch size once per *attention
graph variant* (``AttentionGraphVariants``: capture labels, and ``select`` per batch; SGLang's DSA
models capture a dense and a sparse variant this way). ``PageTableGraphs`` is such a variant set:
``plain`` (SGLang's graph as it is: every layer reads ``req_to_token``) and ``kvx_page_tables``, whose
capture records every attention layer reading its table from static buffers
(``serve/page_tables.GraphTables``). Before each replay of that variant the buffers are filled from
the batch's page tables, planned on the host as an eager forward plans them (one host-to-device copy)
and copied on the device, where SGLang prepares a replay's metadata (``init_forward_metadata_out_graph``).
Batches of plain rows and children of flat contexts select ``plain`` and pay nothing.

Where it runs: the CPU graph emulation (``graph_runners.py``) installs it for ``kvx_torch_native``
(standing in there for a capturable backend). On CUDA no graph runner installs it (SGLang's Triton
backend reads page tables eagerly only, ``triton_tables.py``), so there such batches still run
eagerly (``serve/graph_eligibility.py``). The static buffers are allocated at the first batch that
needs them (the layers' cell space is known only once the scheduler links them); a CUDA capture
would need them before it records.
"""

from __future__ import annotations

import logging

from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant

from sglang_kvx.adapter.batch_reads import planned_reads
from sglang_kvx.adapter.cell_space import cell_space_of
from sglang_kvx.adapter.forward import link_of
from sglang_kvx.serve.page_tables import GraphTables, LayerTable, table_width

logger = logging.getLogger(__name__)

PLAIN, PAGE_TABLES = "plain", "kvx_page_tables"
GRAPHS_ATTR = "_kvx_page_table_graphs"


class PageTableGraphs:
    """SGLang's ``AttentionGraphVariants`` for a backend whose kernel reads page tables: which variant a
    decode batch replays, and the static tables the ``kvx_page_tables`` variant reads."""

    capture_labels = (PLAIN, PAGE_TABLES)  # plain first: the page-table capture's peak covers it

    def __init__(self, backend, max_rows: int, unscaled: bool) -> None:
        self.backend, self.max_rows = backend, max_rows
        self.unscaled = unscaled  # every attention layer's cache holds K and V as they are (no quantisation scale)
        self._tables: GraphTables | None = None
        self._checked = False

    def usable(self) -> bool:
        """Whether batches with such rows may replay the page-table variant: the layers' cells are one address
        space (``cell_space.py``) and unscaled, and the backend is linked to a compacting runtime."""
        if not self._checked:
            link = link_of(self.backend)
            if link is None:
                return False  # asked before the scheduler linked its backends: not settled yet
            self._checked = True
            runtime = link.runtime
            layer_ids = sorted(runtime.compactor.layer_index, key=runtime.compactor.layer_index.get)
            space = cell_space_of(self.backend.token_to_kv_pool, layer_ids) if layer_ids else None
            if space is not None and self.unscaled:
                width = self.backend.req_to_token_pool.req_to_token.shape[1]
                self._tables = GraphTables(layer_ids, self.max_rows, width, space)
                logger.info("sglang_kvx: page-table decode graphs for %d attention layers, up to %d rows: %.1f MiB "
                            "of static tables", len(layer_ids), self.max_rows, self._tables.nbytes / 2**20)
            else:
                logger.info("sglang_kvx: no page-table decode graphs (%s): batches of children of per-layer "
                            "contexts and decode-step rows run eagerly",
                            "scaled KV caches" if not self.unscaled else "the pool's layers are not one allocation")
        return self._tables is not None

    def fits(self, forward_batch) -> bool:
        """Whether the batch's tables fit the static ones (a child's list may outgrow its row: its kept ranks of a
        layer can outnumber its context's slots); where not, the batch runs eagerly."""
        if not self.usable():
            return False
        reads = planned_reads(self.backend, forward_batch)
        return reads is None or all(table is None or table_width(table) <= self._tables.width for table in reads.tables)

    def select(self, forward_batch) -> str:
        """The variant ``forward_batch`` replays (SGLang's runner asks before each replay)."""
        return PAGE_TABLES if self.usable() and planned_reads(self.backend, forward_batch) is not None else PLAIN

    def prepare(self, forward_batch) -> None:
        """Out of the graph, before a replay: fill the static tables when the batch replays ``kvx_page_tables``."""
        if self.select(forward_batch) != PAGE_TABLES:
            return
        batch = link_of(self.backend).batch(forward_batch)
        self._tables.fill(planned_reads(self.backend, forward_batch), forward_batch.req_pool_indices,
                          forward_batch.seq_lens, batch.seq_lens, self.backend.req_to_token_pool.req_to_token)

    def layer_table(self, layer_id: int, forward_batch) -> LayerTable | None:
        """In the graph (its capture, and the emulation's replay): attention layer ``layer_id``'s static table
        when the variant being recorded is ``kvx_page_tables``, else None (SGLang's own path)."""
        if get_capture_attention_variant() != PAGE_TABLES or not self.usable():
            return None
        index = self._tables.index_of.get(layer_id)
        return None if index is None else self._tables.layer_table(index, forward_batch.batch_size)


def install_page_table_graphs(backend, max_rows: int, layers) -> PageTableGraphs:
    """Give ``backend`` (a page-table reader) the page-table variant for graphs of up to ``max_rows`` rows;
    ``layers``: the model's attention layers (their scales decide whether a table may be read as it is)."""
    unscaled = all(scale is None or float(scale) == 1.0 for layer in layers
                   for scale in (getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)))
    graphs = PageTableGraphs(backend, max_rows, unscaled)
    object.__setattr__(backend, GRAPHS_ATTR, graphs)
    return graphs


def page_table_graphs_of(backend) -> PageTableGraphs | None:
    return getattr(backend, GRAPHS_ATTR, None)
