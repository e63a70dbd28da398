"""Per-layer reads of compacted prefixes and decode-step spans, for any SGLang full-attention backend.

A compacted context holds S rank slots at the start of a child's row. With per-layer budgets
(PyramidKV, gate-proportional) layer l keeps K_l entries: the first min(K_l, S) in its own buffer
and, when K_l > S, the rest in cells another layer leaves empty (``compact/layout.py``); per-head
budgets differ per KV head too; a decode step's span reads sinks and a window of a row. SGLang's
backends read every slot of a request's row in every layer.

``per_layer_lengths_class`` derives, from any backend class, a subclass that plans, once per forward
batch in ``init_forward_metadata``, what each layer's rows read: page tables (``batch_reads.py``,
``serve/page_tables.py``; cells of other layers through the pool's one allocation, ``cell_space.py``). A backend whose own
kernel reads a page table (``ReadsPageTables``: ``kvx_torch_native``, the CPU default; SGLang's Triton
backend, ``triton_tables.py``) serves them there; every other backend (FlashInfer, FA3), and layers a table cannot say
(a scaled cache; cells of other layers where the pool has no cell space), run those rows through ``masked_attention`` (plain
torch or the kernel layer's ops, on whatever device the pool lives); every other layer and batch runs
through the backend unchanged. ``with_per_layer_lengths`` switches a built instance to it (SGLang's
isinstance checks still hold); the plugin applies it to every full-attention backend SGLang builds.
In a captured decode graph a page-table reader reads static tables filled before each replay
(``graph_tables.py``: the graph's page-table variant); on other backends batches with such rows run
eagerly: the plugin keeps them off captured graphs.

The same subclass serves ``--kvx-sparse-attention``: every layer of every batch then runs
``sparse_attention`` (the kernel layer's block-sparse ops), eagerly as well.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_kvx.adapter.batch_reads import batch_reads_of, masked_rows_of
from sglang_kvx.adapter.forward import link_of
from sglang_kvx.adapter.graph_replay import DECODE, on_capture_path, replaying
from sglang_kvx.adapter.graph_tables import page_table_graphs_of
from sglang_kvx.ops.prefix_attention import prefix_cells_attention
from sglang_kvx.ops.window_attention import window_attention
from sglang_kvx.serve.page_tables import LayerTable, one_head_per_cell


class PerLayerLengths:
    """Marks a backend class that reads a compacted prefix per layer (masked ranks, borrowed cells)."""

    __slots__ = ()  # adds nothing to an instance's layout, so a built backend can take the subclass


class ReadsPageTables:
    """Marks a backend class whose own kernel reads a layer's page table (``serve/page_tables.py``):
    it defines ``forward_page_table(q, k, v, layer, forward_batch, save_kv_cache, table, decode)``."""

    __slots__ = ()


def _sparse_budget(backend, layer, forward_batch) -> int:
    """Tokens each query attends to under ``--kvx-sparse-attention`` (0: dense)."""
    link = link_of(backend)
    if link is None or layer.is_cross_attention or not link.runtime.config.sparse_budget:
        return 0
    if on_capture_path(forward_batch.req_pool_indices):
        return 0  # graphs are captured on dummy rows; sparse batches never replay one (around_can_run_graph)
    return link.runtime.config.sparse_budget


def _forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    return _forward(self, q, k, v, layer, forward_batch, save_kv_cache, False, **kwargs)


def _forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    return _forward(self, q, k, v, layer, forward_batch, save_kv_cache, True, **kwargs)


def _forward(backend, q, k, v, layer, forward_batch, save_kv_cache, decode: bool, **kwargs):
    if budget := _sparse_budget(backend, layer, forward_batch):
        return sparse_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, budget, decode, **kwargs)
    base = backend._kvx_base.forward_decode if decode else backend._kvx_base.forward_extend
    if not isinstance(backend, ReadsPageTables):  # a backend without a page-table reader: masks per layer
        masked = masked_rows_of(backend, layer, forward_batch)
    elif on_capture_path(forward_batch.req_pool_indices):  # in a graph: its static tables, or SGLang's own path
        graphs = page_table_graphs_of(backend) if decode and not layer.is_cross_attention else None
        table = graphs.layer_table(layer.layer_id, forward_batch) if graphs is not None else None
        if table is None:
            return base(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        _check_plain_layer(layer, kwargs, "a page table in a captured graph")
        return backend.forward_page_table(q, k, v, layer, forward_batch, save_kv_cache, table, decode)
    else:
        reads = None if layer.is_cross_attention else batch_reads_of(backend, forward_batch)
        index = link_of(backend).runtime.compactor.layer_index.get(layer.layer_id) if reads is not None else None
        if index is None:
            return base(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        table = reads.tables[index]
        if table is not None and _unscaled(layer):
            _check_plain_layer(layer, kwargs, "a compacted context's page table")
            return backend.forward_page_table(q, k, v, layer, forward_batch, save_kv_cache, table, decode)
        # A scaled (quantised) cache: the masked path applies the layer's scales.
        masked = reads.masked[index] if table is None else masked_rows_of(backend, layer, forward_batch)
    if not masked:
        return base(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    link_of(backend).masked_attention_calls += 1
    return masked_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, masked, decode=decode, **kwargs)


def _unscaled(layer) -> bool:
    """Whether the layer's cache holds keys and values as they are (SGLang's SDPA path applies no scale)."""
    return all(scale is None or float(scale) == 1.0 for scale in (layer.k_scale, layer.v_scale))


def _init_forward_metadata(self, forward_batch) -> None:
    self._kvx_base.init_forward_metadata(self, forward_batch)
    if not isinstance(self, ReadsPageTables):
        return
    if replaying() == DECODE:  # the emulation's replay: what SGLang prepares out of the graph before one
        _prepare_graph_tables(self, forward_batch)
    else:
        batch_reads_of(self, forward_batch)  # planned here, once per batch, before any layer runs


def _init_forward_metadata_out_graph(self, forward_batch, *args, **kwargs) -> None:
    """SGLang's replay preparation (out of the graph, before ``graph.replay()``): the base backend's (its own
    arguments passed through), then the page-table variant's static tables when the batch replays it
    (``graph_tables.py``); not while capturing (``in_capture``, SGLang's first argument after the batch)."""
    self._kvx_base.init_forward_metadata_out_graph(self, forward_batch, *args, **kwargs)
    in_capture = kwargs.get("in_capture", args[0] if args else False)
    if not in_capture and isinstance(self, ReadsPageTables):
        _prepare_graph_tables(self, forward_batch)


def _prepare_graph_tables(backend, forward_batch) -> None:
    graphs = page_table_graphs_of(backend)
    if graphs is not None and forward_batch.forward_mode.is_decode():
        graphs.prepare(forward_batch)


_SUBCLASSES: dict[type, type] = {}


def per_layer_lengths_class(backend_class: type) -> type:
    """``backend_class`` with per-layer lengths: a subclass overriding ``forward_extend`` and
    ``forward_decode`` (one per backend class). The backend class comes first in the bases and
    the subclass adds no slots, so a built instance can switch to it."""
    if issubclass(backend_class, PerLayerLengths):
        return backend_class
    if backend_class not in _SUBCLASSES:
        namespace = {"__module__": __name__, "__slots__": (), "_kvx_base": backend_class,
                     "__doc__": f"{backend_class.__name__} with per-layer lengths of compacted prefixes.",
                     "forward_extend": _forward_extend, "forward_decode": _forward_decode,
                     "init_forward_metadata": _init_forward_metadata,
                     "init_forward_metadata_out_graph": _init_forward_metadata_out_graph}
        _SUBCLASSES[backend_class] = type(f"Kvx{backend_class.__name__}", (backend_class, PerLayerLengths), namespace)
    return _SUBCLASSES[backend_class]


def register_page_table_reader(backend_class: type, reader_class: type) -> None:
    """What ``with_per_layer_lengths`` gives a built ``backend_class``: ``reader_class``, a page-table reader
    (``per_layer_lengths_class(backend_class)`` and ``ReadsPageTables``) defined in its own module."""
    if not (issubclass(reader_class, backend_class) and issubclass(reader_class, ReadsPageTables)):
        raise TypeError(f"{reader_class.__name__} must derive from {backend_class.__name__} and read page tables")
    _SUBCLASSES[backend_class] = reader_class


def with_per_layer_lengths(backend):
    """Give a built full-attention backend per-layer lengths, in place; returns it."""
    backend.__class__ = per_layer_lengths_class(type(backend))
    return backend


def page_table_reader(backend):
    """The full-attention backend inside ``backend`` whose kernel reads page tables, or None."""
    if isinstance(backend, ReadsPageTables):
        return backend
    for name in ("full_attn_backend", "decode_backend"):
        inner = getattr(backend, name, None)
        if inner is not None and (found := page_table_reader(inner)) is not None:
            return found
    return None


def has_per_layer_lengths(backend) -> bool:
    """Whether every full-attention backend inside ``backend`` (SGLang nests them: hybrid GDN
    wraps the full-attention one, a prefill/decode split holds two) masks per-layer lengths."""
    if isinstance(backend, PerLayerLengths):
        return True
    inner = [getattr(backend, name) for name in ("full_attn_backend", "prefill_backend", "decode_backend")
             if getattr(backend, name, None) is not None]
    return bool(inner) and all(has_per_layer_lengths(b) for b in inner)


class KvxTorchNativeAttnBackend(per_layer_lengths_class(TorchNativeAttnBackend), ReadsPageTables):
    """SGLang's torch-native attention with per-layer lengths: the CPU default, registered as
    ``kvx_torch_native``. Its extend computes the new tokens' queries only where they are under
    half the row. SGLang's runs causal attention for every position of the row, prefix included,
    and drops the prefix's rows, so a radix-cache hit costs a whole-row attention on CPU (one new
    token after a cached 32K prompt took 12 minutes in ``perf/bench_oda.py``). Where the new
    tokens are half the row or more, SGLang's causal pass (which skips the masked half) is the
    cheaper one and runs as it is. A decode step over a page table attends every table row in one
    SDPA call (``_table_decode``); plain rows decode by SGLang's loop over rows, unchanged."""

    __slots__ = ()
    EXTEND_QUERY_BLOCK = 1024  # queries per masked SDPA call: bounds the [block, keys] mask

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to capture. Only the CPU graph emulation asks (``graph_replay.py``: this backend stands
        in there for a capturable one such as FA3); graphs are declared off for it everywhere else."""

    def forward_page_table(self, q, k, v, layer, forward_batch, save_kv_cache: bool, table: LayerTable,
                           decode: bool) -> torch.Tensor:
        """One layer's attention over its page table, by the same SDPA code as every plain row: the table
        stands in for ``req_to_token``, its rows for the batch's rows and its counts for their lengths."""
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, layer.k_scale, layer.v_scale)
        q_heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
        if table.space is not None:  # it reads cells of other layers' buffers too
            k_cache, v_cache = table.space.keys, table.space.values
        else:
            k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        k_cache, v_cache = one_head_per_cell(k_cache, v_cache, table)
        if table.heads:  # one list per (row, KV head): every cell seen as one head's, each KV head's queries a group
            q_heads, kv_heads = q_heads // kv_heads, 1
        q_ = q.reshape(-1, q_heads, layer.qk_head_dim)
        if table.order is not None:  # a per-head extend: its queries (row, KV head)-major, as the table's rows
            q_ = q_[table.order]
        out = q_.new_empty((q_.shape[0], q_heads, layer.v_head_dim))
        count = table.cells.shape[0]
        rows = link_of(self).batch(forward_batch).shared(("table_rows", count), lambda: torch.arange(
            count, device=table.cells.device))
        gqa = q_heads != kv_heads
        if decode and table.lens_host is not None:
            self._table_decode(q_, out, k_cache, v_cache, table, layer.scaling, gqa)
        elif decode:  # a captured graph's static table (its counts on the device only): SGLang's loop over rows
            self._run_sdpa_forward_decode(q_, out, k_cache, v_cache, table.cells, rows, table.lens,
                                          scaling=layer.scaling, enable_gqa=gqa, causal=False)
        else:
            new = table.extend_lens if table.extend_lens is not None else forward_batch.extend_seq_lens
            self._run_sdpa_forward_extend(q_, out, k_cache, v_cache, table.cells, rows, table.lens, table.prefix_lens,
                                          new, scaling=layer.scaling, enable_gqa=gqa, causal=True)
        if table.order is not None:
            out = torch.empty_like(out).index_copy_(0, table.order, out)  # back to the batch's token order
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    DECODE_GATHER_BYTES = 64 << 20  # keys and values gathered per SDPA call of a table decode

    def _table_decode(self, query, output, k_cache, v_cache, table: LayerTable, scaling, enable_gqa: bool) -> None:
        """A decode step over a page table: every table row's cells gathered (padded to the widest row of
        the chunk, the padding masked) and attended by one SDPA call per chunk of rows, where SGLang's decode
        loops over rows in Python (a per-head table has a row per row and KV head)."""
        lens = table.lens_host
        per_row = 2 * k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size()  # bytes per cell of K and V
        start = 0
        while start < len(lens):
            end, width = start, 0
            while end < len(lens) and (end == start or max(width, lens[end]) * (end + 1 - start) * per_row
                                       <= self.DECODE_GATHER_BYTES):
                width = max(width, lens[end])
                end += 1
            cells = table.cells[start:end, :width]
            keys = k_cache[cells].movedim(1, 2).to(query.dtype)  # [rows, Hkv, width, D]
            values = v_cache[cells].movedim(1, 2).to(query.dtype)
            visible = torch.arange(width, device=cells.device)[None, :] < table.lens[start:end, None]
            attended = torch.nn.functional.scaled_dot_product_attention(
                query[start:end, :, None, :], keys, values, attn_mask=visible[:, None, None, :], scale=scaling,
                enable_gqa=enable_gqa)
            output[start:end] = attended.squeeze(2)
            start = end

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if not causal or encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
            return super()._run_sdpa_forward_extend(  # cross-attention and sliding windows: SGLang's own
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        start_q = 0
        for i, (row, seq_len, prefix_len, q_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                                                 extend_prefix_lens.tolist(), extend_seq_lens.tolist())):
            if 2 * q_len >= seq_len:  # a causal pass over the row costs seq_len^2 / 2, under q_len * seq_len
                one = slice(i, i + 1)
                super()._run_sdpa_forward_extend(
                    query[start_q:start_q + q_len], output[start_q:start_q + q_len], k_cache, v_cache, req_to_token,
                    req_pool_indices[one], seq_lens[one], extend_prefix_lens[one], extend_seq_lens[one],
                    scaling=scaling, enable_gqa=enable_gqa, causal=causal)
                start_q += q_len
                continue
            slots = req_to_token[row, :seq_len]
            keys = k_cache[slots].movedim(0, -2).unsqueeze(0)  # [1, Hkv, seq_len, D]
            values = v_cache[slots].movedim(0, -2).unsqueeze(0)
            queries = query[start_q:start_q + q_len].movedim(0, -2).unsqueeze(0)  # [1, Hq, q_len, D]
            keys, values = keys.to(queries.dtype), values.to(queries.dtype)
            for q0 in range(0, q_len, self.EXTEND_QUERY_BLOCK):
                q1 = min(q_len, q0 + self.EXTEND_QUERY_BLOCK)
                end = prefix_len + q1  # keys past the block's last query are never visible
                visible = (torch.arange(end, device=query.device)[None, :]
                           <= torch.arange(prefix_len + q0, end, device=query.device)[:, None])
                out = torch.nn.functional.scaled_dot_product_attention(
                    queries[:, :, q0:q1], keys[:, :, :end], values[:, :, :end], attn_mask=visible,
                    scale=scaling, enable_gqa=enable_gqa)
                output[start_q + q0:start_q + q1] = out.squeeze(0).movedim(-2, 0)
            start_q += q_len
        return output


register_page_table_reader(TorchNativeAttnBackend, KvxTorchNativeAttnBackend)  # what torch_native gets


def _check_plain_layer(layer, kwargs, what: str) -> None:
    unsupported = sorted(name for name, value in kwargs.items() if value is not None)
    if unsupported:
        raise NotImplementedError(f"{what} with attention options {unsupported}")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError(f"{what} with sliding-window attention")
    if getattr(layer, "logit_cap", 0) or getattr(layer, "is_cross_attention", False):
        raise NotImplementedError(f"{what} with logit capping or cross-attention")


def sparse_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, budget: int, decode: bool, **kwargs):
    """``--kvx-sparse-attention``: every row's queries attend to ``budget`` tokens in four-token
    blocks (``ops/block_sparse.py``: the first block, the query's own and the indexer's best). A
    child of a compacted context reads, in each layer, the entries that layer kept (own ranks,
    then cells borrowed from other layers' buffers), regrouped into new blocks, then its own tokens:
    the layer's page table (``batch_reads_of``). Rows are grouped into blocks once per batch for every
    layer reading the same table (``plan_blocks``); only the indexer's keys and choices are per layer."""
    from sglang_kvx.ops.block_sparse import plan_blocks

    _check_plain_layer(layer, kwargs, "block-sparse attention")
    if any(scale is not None and float(scale) != 1.0 for scale in (layer.k_scale, layer.v_scale)):
        raise NotImplementedError("block-sparse attention with scaled (quantised) KV caches")
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, layer.k_scale, layer.v_scale)
    link = link_of(backend)
    runtime, batch = link.runtime, link.batch(forward_batch)
    index = runtime.compactor.layer_index.get(layer.layer_id)
    reads = batch_reads_of(backend, forward_batch) if index is not None else None
    table = reads.tables[index] if reads is not None else None
    if reads is not None and reads.masked[index]:
        return _sparse_attention_masked(backend, q, layer, forward_batch, budget, decode, reads.masked[index])
    if table is not None and table.heads:  # refused at the door (settings): never here
        raise NotImplementedError("block-sparse attention over a context compacted with per-head budgets")
    if table is not None and table.space is not None:  # it reads cells of other layers' buffers too
        k_cache, v_cache = table.space.keys, table.space.values
    else:
        k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    q_lens = [1] * len(batch.rows) if decode else list(forward_batch.extend_seq_lens_cpu)
    if table is None:  # every row reads its whole row: one plan for every such layer of the batch
        row_keys = batch.shared("sparse_whole_rows", lambda: [
            backend.req_to_token_pool.req_to_token[row, :seq_len].long() for row, seq_len in zip(batch.rows, batch.seq_lens)])
    else:
        row_keys = batch.shared(("sparse_rows", id(table)), lambda: [
            table.cells[i, :n] for i, n in enumerate(table.lens_host)])
    plan = batch.shared(("sparse_plan", id(table)), lambda: plan_blocks(row_keys, q_lens, q.device))
    return _sparse_rows(link, batch, q, layer, k_cache, v_cache, row_keys, q_lens, budget, plan=plan)


def _sparse_attention_masked(backend, q, layer, forward_batch, budget: int, decode: bool, masked) -> torch.Tensor:
    """Block-sparse attention where the layer's page table cannot say what its rows read (cells of other
    layers in a pool without a cell space): the borrowed cells gathered per layer as extra keys."""
    pool = backend.token_to_kv_pool
    k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    link = link_of(backend)
    batch = link.batch(forward_batch)
    req_to_token = backend.req_to_token_pool.req_to_token
    row_keys, extra_k, extra_v, extra_count = [], [], [], 0
    for i, (row, seq_len) in enumerate(zip(batch.rows, batch.seq_lens)):
        slots = req_to_token[row, :seq_len].long()
        cells = masked.get(i)
        if cells is not None and cells.head_own is not None:  # refused at the door (settings): never here
            raise NotImplementedError("block-sparse attention over a context compacted with per-head budgets")
        if cells is not None:  # the layer's kept ranks: own cells, borrowed cells, then the child's tokens
            pieces = [slots[: cells.own]]
            for layer_id, at in cells.borrowed:
                extra_k.append(pool.get_key_buffer(layer_id)[at])
                extra_v.append(pool.get_value_buffer(layer_id)[at])
                pieces.append(k_cache.shape[0] + extra_count + torch.arange(at.numel(), device=slots.device))
                extra_count += at.numel()
            slots = torch.cat(pieces + [slots[cells.num_slots :]])
        row_keys.append(slots)
    q_lens = [1] * len(row_keys) if decode else list(forward_batch.extend_seq_lens_cpu)
    return _sparse_rows(link, batch, q, layer, k_cache, v_cache, row_keys, q_lens, budget,
                        extra=(torch.cat(extra_k), torch.cat(extra_v)) if extra_k else None)


def _sparse_rows(link, batch, q, layer, k_cache, v_cache, row_keys, q_lens, budget: int, plan=None, extra=None):
    """One layer's block-sparse attention over ``row_keys``, its compressed keys kept in the sparse index."""
    from sglang_kvx.ops.block_sparse import BLOCK, paged_block_sparse_attention

    num_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
    sparse_index, layer_key = link.runtime.sparse_index, layer.layer_id
    out, block_keys = paged_block_sparse_attention(
        q.reshape(-1, num_heads, head_dim), k_cache, v_cache, row_keys, q_lens, budget // BLOCK, 1, layer.scaling,
        extra_keys=extra[0] if extra else None, extra_values=extra[1] if extra else None,
        known_block_keys=[sparse_index.known(row, layer_key) for row in batch.rows], plans=link.kernel_plans, plan=plan)
    for row, keys, slots in zip(batch.rows, block_keys, row_keys):
        sparse_index.keep(row, layer_key, keys, slots.numel())
    return out.reshape(-1, num_heads * layer.v_head_dim)


def masked_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, masked, decode: bool, **kwargs):
    """Exact attention for every row of the batch; a row in ``masked`` reads, in this layer, only
    its own ranks of the compacted prefix plus the cells it borrowed from other layers' buffers.
    Reads the pool the same way as the backend: row slots from ``req_to_token``; keys cached
    after RoPE (a borrowed cell holds this layer's raw bytes, so this layer's scales apply).
    A decode batch whose rows each hide one interval runs the windowed decode op (``ops/window_attention.py``:
    FlashInfer or Triton on CUDA); others the prefix-cells op (``ops/prefix_attention.py``); torch references elsewhere."""
    _check_plain_layer(layer, kwargs, "per-layer compacted lengths")
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, layer.k_scale, layer.v_scale)
    num_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    rows = forward_batch.req_pool_indices
    batch = rows.numel()
    q_lens = torch.ones(batch, dtype=torch.long, device=rows.device) if decode else forward_batch.extend_seq_lens
    kv_heads = k_cache.shape[1]
    per_head = any(cells.head_own is not None for cells in masked.values())

    def each_head(value: int) -> int | list[int]:
        return [value] * kv_heads if per_head else value

    # Hidden ranges [lo, hi) per row (per row and KV head under per-head budgets), built on the host
    # and copied to the device once: per-element tensor writes cost more than the attention here.
    lo, hi = [each_head(0)] * batch, [each_head(0)] * batch
    head_counts = torch.zeros((batch, kv_heads), dtype=torch.long) if per_head else None
    extra_k, extra_v, extra_counts = [], [], [0] * batch
    for i, cells in masked.items():
        if cells.head_own is not None:  # per-head budgets: each KV head hides its own range and borrows its own cells
            lo[i], hi[i] = list(cells.head_own), each_head(cells.num_slots)
            keys, values, counts = _borrowed_per_head(pool, cells.head_borrowed, k_cache, v_cache)
            extra_k.append(keys)
            extra_v.append(values)
            extra_counts[i], head_counts[i] = keys.shape[0], counts
            continue
        lo[i], hi[i] = each_head(cells.own), each_head(cells.num_slots)  # ranks this layer does not keep here
        for layer_id, at in cells.borrowed:  # its further ranks, in other layers' buffers
            extra_k.append(pool.get_key_buffer(layer_id)[at])
            extra_v.append(pool.get_value_buffer(layer_id)[at])
            extra_counts[i] += at.numel()
        if per_head:
            head_counts[i] = extra_counts[i]
    k_scale = 1.0 if layer.k_scale is None else float(layer.k_scale)
    v_scale = 1.0 if layer.v_scale is None else float(layer.v_scale)
    if decode and not extra_k and not per_head:
        # One hidden interval [a, b) per row and one query: sinks a plus a window of seq_len - b
        # (a row hiding nothing reads all: window 0) -- the kernel layer's windowed decode op.
        link = link_of(backend)
        view = link.batch(forward_batch)  # rows and seq_lens read on the host once per batch
        window = [n - b if b > a else 0 for n, a, b in zip(view.seq_lens, lo, hi)]
        # Layers hiding the same ranges read the same cells: FlashInfer plans once for all of them, and
        # the ranges go to the device once per batch (a StreamingLLM row hides the same in every layer).
        plan_key = (tuple(view.rows), tuple(view.seq_lens), tuple(lo), tuple(hi))
        sinks_and_window = view.shared(("sinks_and_window", plan_key), lambda: torch.tensor(
            [lo, window], dtype=torch.long, device=rows.device))
        out = window_attention(q.reshape(-1, num_heads, head_dim), k_cache, v_cache,
                               backend.req_to_token_pool.req_to_token, rows, forward_batch.seq_lens,
                               sinks_and_window[0], sinks_and_window[1],
                               scaling=layer.scaling, k_scale=k_scale, v_scale=v_scale,
                               plans=link.kernel_plans, plan_key=plan_key)
        return out.reshape(-1, num_heads * layer.v_head_dim)
    hidden = torch.tensor([lo, hi], dtype=torch.long, device=rows.device)
    extra_indptr = torch.tensor([0] + extra_counts).cumsum(0).to(rows.device)
    out = prefix_cells_attention(
        q.reshape(-1, num_heads, head_dim), k_cache, v_cache, backend.req_to_token_pool.req_to_token,
        rows, forward_batch.seq_lens, q_lens, hidden[0], hidden[1],
        torch.cat(extra_k) if extra_k else k_cache[:0], torch.cat(extra_v) if extra_v else v_cache[:0], extra_indptr,
        scaling=layer.scaling, k_scale=k_scale, v_scale=v_scale,
        extra_counts=head_counts.to(rows.device) if head_counts is not None else None,
    )
    return out.reshape(-1, num_heads * layer.v_head_dim)


def _borrowed_per_head(pool, head_borrowed, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """One row's extra entries under per-head budgets: [E, Hkv, D] keys and values, KV head h's
    further ranks first in its column (E the most any head borrowed), and each head's count."""
    counts = torch.tensor([sum(int(at.numel()) for _, _, at in pieces) for pieces in head_borrowed])
    width = int(counts.max()) if counts.numel() else 0
    keys = k_cache.new_zeros((width, *k_cache.shape[1:]))
    values = v_cache.new_zeros((width, *v_cache.shape[1:]))
    for head, pieces in enumerate(head_borrowed):
        rank = 0
        for layer_id, holder_head, at in pieces:
            keys[rank : rank + at.numel(), head] = pool.get_key_buffer(layer_id)[at, holder_head]
            values[rank : rank + at.numel(), head] = pool.get_value_buffer(layer_id)[at, holder_head]
            rank += at.numel()
    return keys, values, counts
