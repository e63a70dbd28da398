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
table too in decode: one list per (row, KV head) over the cell space seen as cells of one head each,
which any kernel reading one KV head per row serves (its query heads as one group). An extend over a
per-head context (a child's question) stays masked.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    cells: torch.Tensor  # [batch, width] long: row i reads cells[i, :lens_host[i]]
    lens: torch.Tensor  # [batch] long, on the table's device
    lens_host: list[int]
    prefix_lens: torch.Tensor | None  # extend: each row's cells before its new tokens; None in decode
    space: CellSpace | None  # where its addresses point (it borrows other layers' cells); None: the layer's own buffer
    heads: int = 0  # >0: one list per (row, KV head), row-major, over ``space`` seen one head per cell


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
            # Each KV head reads its own cells: one list per (row, KV head), in decode, over the cell space
            # seen one head per row. An extend over such a context (the child's question) stays masked.
            if q_lens is not None or space is None:
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
    counts = [[int(cells.numel()) for cells in row_lists] for row_lists, _, _ in lists]  # host shapes: no device read
    host = [n for table in counts for n in table]
    if q_lens is not None:  # per-row tables only (per-head layers stay masked in an extend)
        host += [n - q for table in counts for n, q in zip(table, q_lens)]
    on_device = torch.tensor(host, dtype=torch.long).to(req_to_token.device)  # the batch's one host-to-device copy
    made, at, prefix_at = [], 0, sum(len(table) for table in counts)  # counts first, then (extend) prefixes
    for (row_lists, table_space, heads), lens_host in zip(lists, counts):
        prefix = None
        if q_lens is not None:
            prefix = on_device[prefix_at : prefix_at + len(lens_host)]
            prefix_at += len(lens_host)
        made.append(LayerTable(torch.nn.utils.rnn.pad_sequence(row_lists, batch_first=True),
                               on_device[at : at + len(lens_host)], lens_host, prefix, table_space, heads))
        at += len(lens_host)
    return BatchReads([made[p] if p is not None else None for p in planned], stay_masked)


def _row_lists(layer_masked: dict[int, PrefixCells], layer_id: int, rows: list[int], seq_lens: list[int],
               req_to_token: torch.Tensor, offsets: dict[int, int] | None) -> list[torch.Tensor]:
    """Each row's cells in this layer: addresses in its own buffer, or (``offsets``) in the cell space."""
    device = req_to_token.device
    own_offset = offsets[layer_id] if offsets is not None else 0
    lists = []
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[row, :seq_len].to(torch.long)
        cells = layer_masked.get(i)
        if cells is not None:
            pieces = [slots[: cells.own]]
            pieces += [at.to(device=device, dtype=torch.long) + ((offsets[other] - own_offset) if offsets else 0)
                       for other, at in cells.borrowed]
            pieces.append(slots[cells.num_slots :])
            slots = torch.cat(pieces)
        lists.append(slots + own_offset if own_offset else slots)
    return lists


def _head_lists(layer_masked: dict[int, PrefixCells], layer_id: int, rows: list[int], seq_lens: list[int],
                req_to_token: torch.Tensor, space: CellSpace) -> list[torch.Tensor]:
    """Each (row, KV head)'s cells in this layer, row-major: addresses of single heads in the cell space
    (cell c's head h is ``c * heads + h``). A head reads its own ranks, the cells it borrows (of any layer
    and head), then the row's tokens; a row without per-head cells reads the same cells in every head."""
    device, heads = req_to_token.device, space.keys.shape[1]
    own_offset = space.offsets[layer_id]
    lists = []
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[row, :seq_len].to(torch.long) + own_offset
        cells = layer_masked.get(i)
        for head in range(heads):
            if cells is None:
                lists.append(slots * heads + head)
                continue
            if cells.head_own is None:
                own = slots[: cells.own]
                pieces = [own * heads + head] + [(at.to(device=device, dtype=torch.long) + space.offsets[other]) * heads + head
                                                 for other, at in cells.borrowed]
            else:
                own = slots[: cells.head_own[head]]
                pieces = [own * heads + head] + [
                    (at.to(device=device, dtype=torch.long) + space.offsets[other]) * heads + holder
                    for other, holder, at in cells.head_borrowed[head]]
            pieces.append(slots[cells.num_slots :] * heads + head)
            lists.append(torch.cat(pieces))
    return lists
