"""What each attention layer of a forward batch reads, as page tables built once per batch.

A child of a compacted context, or a row running a decode step, reads in layer l other than its
whole row: its first ``own`` slots, cells it borrows, then its tokens from slot ``num_slots`` on
(``store.PrefixCells``). Instead of a mask built in every layer, each layer gets one index list per
row -- the cells it reads, its new tokens last and in order (an extend's causal mask counts them
from the end; attention does not depend on the order of the rest) -- which the backend's own kernel
reads as it reads ``req_to_token``: a table ``[batch, width]``, each row's count, and (extend) each
row's cells before its new tokens. Layers whose lists are equal share one table (a StreamingLLM row
hides the same span in every layer: one table per batch).

A list addresses the layer's own buffer. Cells a layer borrows from other layers' buffers (folded
layouts, ``compact/layout.py``) are addressable only where the pool keeps every layer's cells in
one allocation (``CellSpace``: an address is a layer's offset plus its slot); without one, such a
layer stays on the masked path. Per-head budgets (each KV head of a layer reads its own cells) are a
table too: one list per (row, KV head) over the cell space seen as cells of one head each, which any
kernel reading one KV head per row serves (its query heads as one group; an extend's queries reordered
head-major once per batch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sglang_kvx.store import PrefixCells


@dataclass(frozen=True)
class CellSpace:
    """Every attention layer's K cells as one tensor's rows (and V's likewise): ``offsets[layer_id]`` is
    where layer ``layer_id``'s slot 0 sits in ``keys`` and ``values``."""

    keys: torch.Tensor  # [cells, H, D]
    values: torch.Tensor
    offsets: dict[int, int]


@dataclass(frozen=True)
class LayerTable:
    """One layer's page table for a forward batch."""

    cells: torch.Tensor  # [batch, width] long: row i reads cells[i, :lens[i]]
    lens: torch.Tensor  # [batch] long, on the table's device
    lens_host: list[int] | None  # the same counts on the host (None: a captured graph's static table)
    prefix_lens: torch.Tensor | None  # extend: each row's cells before its new tokens; None in decode
    space: CellSpace | None  # where its addresses point (it borrows other layers' cells); None: the layer's own buffer
    heads: int = 0  # >0: one list per (row, KV head), row-major, over ``space`` seen one head per cell
    extend_lens: torch.Tensor | None = None  # a per-head extend: each (row, KV head)'s new tokens
    order: torch.Tensor | None = None  # a per-head extend: ``_head_major_order`` of the batch's queries


@dataclass
class BatchReads:
    """Per attention layer: its table (None: the layer reads every row whole, as the backend does), and
    the rows that must stay masked where a table cannot say what they read (per-head budgets, or
    another layer's cells without a ``CellSpace``)."""

    tables: list[LayerTable | None]
    masked: list[dict[int, PrefixCells]]

    def __bool__(self) -> bool:
        return any(t is not None for t in self.tables) or any(self.masked)


def build_batch_reads(masked: list[dict[int, PrefixCells]], layer_ids: list[int], rows: list[int],
                      seq_lens: list[int], q_lens: list[int] | None, req_to_token: torch.Tensor,
                      space: CellSpace | None) -> BatchReads:
    """The batch's page tables from what each attention layer's rows read (``masked[l]``: batch index
    -> cells, for rows that do not read their whole row there). ``q_lens``: each row's new tokens in
    an extend, None in decode. Reads nothing back from the device, and copies host values to it once
    (every table's counts together)."""
    stay_masked: list[dict[int, PrefixCells]] = [{} for _ in masked]
    planned: list[int | None] = [None] * len(masked)  # layer -> index into ``lists``
    lists: list[tuple[list[torch.Tensor], CellSpace | None, int]] = []  # (its lists, its space, KV heads split)
    shared: dict[tuple, int] = {}
    for index, (layer_masked, layer_id) in enumerate(zip(masked, layer_ids)):
        if not layer_masked:
            continue
        if any(cells.head_own is not None for cells in layer_masked.values()):
            # Each KV head reads its own cells: one list per (row, KV head), over the cell space seen one
            # head per cell.
            if space is None:
                stay_masked[index] = layer_masked
                continue
            planned[index] = len(lists)
            lists.append((_head_lists(layer_masked, layer_id, rows, seq_lens, req_to_token, space), space,
                          space.keys.shape[1]))
            continue
        across = any(other != layer_id for cells in layer_masked.values() for other, _ in cells.borrowed)
        if across and space is None:
            stay_masked[index] = layer_masked
            continue
        key = None if across else tuple(sorted(
            (i, c.num_slots, c.own, tuple(id(at) for _, at in c.borrowed)) for i, c in layer_masked.items()))
        if key is not None and key in shared:
            planned[index] = shared[key]
            continue
        offsets = space.offsets if across else None
        planned[index] = len(lists)
        lists.append((_row_lists(layer_masked, layer_id, rows, seq_lens, req_to_token, offsets),
                      space if across else None, 0))
        if key is not None:
            shared[key] = planned[index]
    if not lists:
        return BatchReads([None] * len(masked), stay_masked)
    # Every table's counts, then (extend) its cells before the new tokens, then (a per-head extend) each
    # (row, KV head)'s new tokens: host values, gathered for the batch's one host-to-device copy.
    host: list[int] = []
    spans = []
    for row_lists, _, heads in lists:
        lens_host = [int(cells.numel()) for cells in row_lists]  # host shapes: no device read
        new = None if q_lens is None else [q for q in q_lens for _ in range(max(heads, 1))]
        parts = [lens_host] + ([] if new is None else [[n - q for n, q in zip(lens_host, new)]]) + (
            [new] if new is not None and heads else [])
        spans.append((lens_host, [_append(host, part) for part in parts]))
    on_device = torch.tensor(host, dtype=torch.long).to(req_to_token.device)  # the batch's one host-to-device copy
    orders: dict[int, torch.Tensor] = {}
    made = []
    for (row_lists, table_space, heads), (lens_host, parts) in zip(lists, spans):
        pieces = [on_device[a:b] for a, b in parts]
        order = None
        if heads and q_lens is not None:
            if heads not in orders:
                orders[heads] = _head_major_order(q_lens, heads, req_to_token.device)
            order = orders[heads]
        made.append(LayerTable(torch.nn.utils.rnn.pad_sequence(row_lists, batch_first=True), pieces[0], lens_host,
                               pieces[1] if len(pieces) > 1 else None, table_space, heads,
                               pieces[2] if len(pieces) > 2 else None, order))
    return BatchReads([made[p] if p is not None else None for p in planned], stay_masked)


class TableCarry:
    """A decode batch's page tables, kept for its next step. From one decode step to the next every list
    of every table gains one cell at its end -- its row's newest token, seen in the table's address space
    -- as long as the batch holds the same requests in the same rows, each one token longer, reading the
    same cells otherwise (the same ``PrefixCells`` objects: a compacted context's are its own for the
    request's life; a decode step's span is built anew each step, so its batches are rebuilt). Then
    ``advance`` writes that one column on the device instead of rebuilding every list at full width, and
    copies nothing from the host (the counts grow on the device); tables grow ``GROW`` columns at a time."""

    GROW = 128

    def __init__(self) -> None:
        self._last: tuple | None = None  # (reads, masked, rows, requests, seq_lens, layer_ids)

    @property
    def holding(self) -> bool:
        return self._last is not None

    def keep(self, reads: BatchReads | None, masked: list[dict[int, PrefixCells]], rows: list[int],
             requests: list, seq_lens: list[int], layer_ids: list[int]) -> None:
        """A decode step's freshly built tables and what they were built from."""
        self._last = (reads, masked, tuple(rows), tuple(requests), list(seq_lens), layer_ids) if reads else None

    def advance(self, masked: list[dict[int, PrefixCells]], rows: list[int], requests: list, seq_lens: list[int],
                new_slots: torch.Tensor) -> BatchReads | None:
        """This decode step's tables from the last step's, or None where they must be built anew.
        ``new_slots``: each row's newest token's slot (``req_to_token[row, seq_len - 1]``), on the device."""
        last, self._last = self._last, None
        if last is None:
            return None
        reads, was_masked, was_rows, was_requests, was_lens, layer_ids = last
        if (tuple(rows) != was_rows or tuple(requests) != was_requests or len(masked) != len(was_masked)
                or any(now != was + 1 for now, was in zip(seq_lens, was_lens)) or any(reads.masked)
                or any(now.keys() != was.keys() or any(now[i] is not was[i] for i in now)
                       for now, was in zip(masked, was_masked))):
            return None
        grown: dict[int, LayerTable] = {}
        tables: list[LayerTable | None] = []
        for layer_id, table in zip(layer_ids, reads.tables):
            if table is not None and id(table) not in grown:
                # A table in another layer's addresses (the cell space) is that layer's alone; shared ones are not.
                offset = table.space.offsets[layer_id] if table.space is not None else 0
                grown[id(table)] = self._appended(table, new_slots.to(torch.long) + offset)
            tables.append(grown[id(table)] if table is not None else None)
        carried = BatchReads(tables, reads.masked)
        self._last = (carried, masked, tuple(rows), tuple(requests), list(seq_lens), layer_ids)
        return carried

    def _appended(self, table: LayerTable, addresses: torch.Tensor) -> LayerTable:
        if table.heads:  # each (row, KV head)'s list: the cell's head h
            heads = torch.arange(table.heads, device=addresses.device)
            addresses = (addresses[:, None] * table.heads + heads[None, :]).reshape(-1)
        lens_host = [count + 1 for count in table.lens_host]
        cells = table.cells
        if max(lens_host) > cells.shape[1]:
            cells = torch.nn.functional.pad(cells, (0, self.GROW))
        cells[torch.arange(len(lens_host), device=cells.device), table.lens] = addresses
        return replace(table, cells=cells, lens=table.lens + 1, lens_host=lens_host)

    def clear(self) -> None:
        self._last = None


def one_head_per_cell(k_cache: torch.Tensor, v_cache: torch.Tensor, table: LayerTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V buffers ``[cells, H, D]`` as a table's kernel reads them: as they are, or (a per-head table,
    whose addresses are single heads) as ``[cells * H, 1, D]`` views, one KV head per cell."""
    if not table.heads:
        return k_cache, v_cache
    return k_cache.reshape(-1, 1, k_cache.shape[-1]), v_cache.reshape(-1, 1, v_cache.shape[-1])


def table_width(table: LayerTable) -> int:
    """The longest list of a table (its ``cells`` may be wider: a carried table grows in steps)."""
    return max(table.lens_host, default=0) if table.lens_host is not None else table.cells.shape[1]


def ragged_lists(cells: torch.Tensor, lens: torch.Tensor, lens_host: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first ``lens[i]`` entries of a padded table ``[rows, width]`` as ``(indptr, indices)``: the
    ragged form paged kernels read (SGLang's Triton backend: ``kv_indptr`` int32, ``kv_indices`` int64).
    Built on the device from the host's counts (``lens_host``, the same as ``lens``): nothing is read back."""
    rows, total = len(lens_host), sum(lens_host)
    device = cells.device
    indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(lens, 0)
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), lens, output_size=total)
    column = torch.arange(total, device=device) - indptr[:-1].to(torch.long)[row_of]
    return indptr, cells[row_of, column].to(torch.long)


def _append(host: list[int], values: list[int]) -> tuple[int, int]:
    start = len(host)
    host.extend(values)
    return start, len(host)


def _head_major_order(q_lens: list[int], heads: int, device: torch.device) -> torch.Tensor:
    """Where each (row, KV head, new token) sits among the extend's queries seen one KV head each
    (``[tokens * heads, group, D]``, token-major): the order a per-head table's rows read them in."""
    pieces, start = [], 0
    for q in q_lens:
        pieces += [torch.arange(start * heads + head, (start + q) * heads + head, heads, device=device)
                   for head in range(heads)]
        start += q
    return torch.cat(pieces)


def _row_list(slots: torch.Tensor, cells: PrefixCells | None, device: torch.device,
              offsets: dict[int, int] | None, own_offset: int) -> torch.Tensor:
    """One row's cells in a layer, the same in every KV head: its own ranks, the cells it borrows, then its
    tokens; addresses in the layer's own buffer (``offsets`` None) or in the cell space (the layer at
    ``own_offset``). ``slots``: the row's slots in its own buffer."""
    if cells is not None:
        pieces = [slots[: cells.own]]
        pieces += [at.to(device=device, dtype=torch.long) + ((offsets[other] - own_offset) if offsets else 0)
                   for other, at in cells.borrowed]
        pieces.append(slots[cells.num_slots :])
        slots = torch.cat(pieces)
    return slots + own_offset if own_offset else slots


def _row_lists(layer_masked: dict[int, PrefixCells], layer_id: int, rows: list[int], seq_lens: list[int],
               req_to_token: torch.Tensor, offsets: dict[int, int] | None) -> list[torch.Tensor]:
    """Each row's cells in this layer: addresses in its own buffer, or (``offsets``) in the cell space."""
    own_offset = offsets[layer_id] if offsets is not None else 0
    return [_row_list(req_to_token[row, :seq_len].to(torch.long), layer_masked.get(i), req_to_token.device, offsets,
                      own_offset) for i, (row, seq_len) in enumerate(zip(rows, seq_lens))]


def _head_lists(layer_masked: dict[int, PrefixCells], layer_id: int, rows: list[int], seq_lens: list[int],
                req_to_token: torch.Tensor, space: CellSpace) -> list[torch.Tensor]:
    """Each (row, KV head)'s cells in this layer, row-major: addresses of single heads in the cell space
    (cell c's head h is ``c * heads + h``). A head reads its own ranks, the cells it borrows (of any layer
    and head), then the row's tokens; a row without per-head cells reads the same cells in every head."""
    device, heads = req_to_token.device, space.keys.shape[1]
    own_offset = space.offsets[layer_id]
    lists = []
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[row, :seq_len].to(torch.long)
        cells = layer_masked.get(i)
        if cells is None or cells.head_own is None:  # one list for the row, seen in each head
            row_cells = _row_list(slots, cells, device, space.offsets, own_offset)
            lists += [row_cells * heads + head for head in range(heads)]
            continue
        slots = slots + own_offset
        for head in range(heads):
            pieces = [slots[: cells.head_own[head]] * heads + head] + [
                (at.to(device=device, dtype=torch.long) + space.offsets[other]) * heads + holder
                for other, holder, at in cells.head_borrowed[head]]
            pieces.append(slots[cells.num_slots :] * heads + head)
            lists.append(torch.cat(pieces))
    return lists


class GraphTables:
    """The page tables a captured decode graph reads: static buffers, one table per attention layer, filled
    before each replay of the graph's page-table variant (a graph replays fixed addresses and shapes, so
    neither the per-batch tables' sharing between layers nor their per-row or per-head forms can change
    from one replay to the next). Every table is in the most general form: one list per (row, KV head)
    over the cell space seen one head per cell, so every layer's kernel call has one shape. Its size is
    ``layers * rows * heads * width`` addresses (``nbytes``): allocated once, touched only as far as the
    batches filled reach."""

    def __init__(self, layer_ids: list[int], rows: int, width: int, space: CellSpace) -> None:
        self.layer_ids, self.space, self.heads, self.width = list(layer_ids), space, space.keys.shape[1], width
        self.index_of = {layer_id: index for index, layer_id in enumerate(layer_ids)}
        device = space.keys.device
        self.cells = torch.empty((len(layer_ids), rows * self.heads, width), dtype=torch.long, device=device)
        self.lens = torch.empty((len(layer_ids), rows * self.heads), dtype=torch.long, device=device)
        self._head = torch.arange(self.heads, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return self.cells.nbytes + self.lens.nbytes

    def fill(self, reads: BatchReads | None, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: list[int],
             req_to_token: torch.Tensor) -> None:
        """Write the batch's tables (``reads``: the batch's ``build_batch_reads``; None where every row reads
        its whole row) into the static buffers, rows ``[0, len(seq_lens_host) * heads)`` of every layer: a
        layer without a table reads each row whole. Device copies only; nothing is read back."""
        batch, heads = len(seq_lens_host), self.heads
        if batch * heads > self.cells.shape[1]:
            raise ValueError(f"a batch of {batch} rows in page-table graphs captured for {self.cells.shape[1] // heads}")
        whole_width = max(seq_lens_host, default=0)
        whole = req_to_token[rows, :whole_width].to(torch.long) if whole_width else None
        whole_lens = seq_lens.to(torch.long).repeat_interleave(heads, output_size=batch * heads)
        for index, layer_id in enumerate(self.layer_ids):
            table = reads.tables[index] if reads is not None else None
            if reads is not None and reads.masked[index]:
                raise ValueError(f"attention layer {layer_id} has rows no page table can say (a pool without a cell space)")
            if table is None:
                cells, lens = self._per_head(whole, self.space.offsets[layer_id]), whole_lens
            elif table.heads:
                cells, lens = table.cells[:, : table_width(table)], table.lens
            else:  # one list per row, in the layer's own buffer or (it borrows) the cell space
                offset = 0 if table.space is not None else self.space.offsets[layer_id]
                cells, lens = self._per_head(table.cells[:, : table_width(table)], offset), table.lens.repeat_interleave(
                    heads, output_size=batch * heads)
            if cells is None:
                continue
            if cells.shape[1] > self.width:
                raise ValueError(f"a page table of {cells.shape[1]} cells in graphs captured for {self.width}")
            self.cells[index, : batch * heads, : cells.shape[1]] = cells
            self.lens[index, : batch * heads] = lens

    def _per_head(self, cells: torch.Tensor | None, offset: int) -> torch.Tensor | None:
        """Row lists ``[batch, width]`` of slots at ``offset`` in the cell space as (row, KV head) lists."""
        if cells is None:
            return None
        return ((cells + offset)[:, None, :] * self.heads + self._head[None, :, None]).reshape(-1, cells.shape[1])

    def layer_table(self, index: int, batch: int) -> LayerTable:
        """Attention layer ``index``'s table for a decode batch of ``batch`` rows, as the kernel reads it."""
        count = batch * self.heads
        return LayerTable(self.cells[index, :count], self.lens[index, :count], None, None, self.space, self.heads)
