"""Issue #56 items 1-2: what each attention layer reads, as page tables built once per batch
(``serve/page_tables.py``) and a cell space over every layer's buffer (``adapter/cell_space.py``).

Each table row is checked against the cells the row reads, listed independently from its
``PrefixCells`` (own ranks, borrowed cells in rank order, then its own tokens); attention through a
table, by SGLang's own torch-native SDPA code, equals attention over those cells gathered by hand."""

from __future__ import annotations

import torch

from sglang_kvx.serve.page_tables import CellSpace, build_batch_reads
from sglang_kvx.ops.host_syncs import HostSyncCounter
from sglang_kvx.store import PrefixCells

LAYERS, SLOTS, HEADS, DIM = 3, 64, 2, 4


def arena():
    """Three layers' [2, SLOTS, H, D] K/V tensors as slices of one allocation, as the plugin makes them."""
    whole = torch.randn(LAYERS, 2, SLOTS, HEADS, DIM)
    flat = whole.view(-1, HEADS, DIM)
    space = CellSpace(keys=flat, values=flat[SLOTS:], offsets={10 + layer: 2 * SLOTS * layer for layer in range(LAYERS)})
    return whole, space


def test_tables_list_each_rows_cells_share_equal_layers_and_copy_host_values_once():
    whole, space = arena()
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    rows, seq_lens = [2, 0], [12, 9]
    borrowed = torch.tensor([40, 41, 42])
    span = PrefixCells(num_slots=7, own=2)  # a decode step's span: slots [2, 7) hidden, in every layer
    folded = PrefixCells(num_slots=6, own=4, borrowed=((12, borrowed),))  # ranks 4.. in layer 12's cells
    masked = [{0: span}, {1: folded}, {0: span}]  # layers 10, 11, 12
    with HostSyncCounter() as counter:
        reads = build_batch_reads(masked, [10, 11, 12], rows, seq_lens, None, req_to_token, space)
    assert counter.total == 1, dict(counter.counts)  # the one copy of every table's counts
    first, third, second = reads.tables
    assert first is second and not any(reads.masked)  # equal lists in two layers: one table
    assert first.space is None and first.lens_host == [7, 9]
    assert first.cells[0, :7].tolist() == [32, 33, 39, 40, 41, 42, 43] and first.cells[1, :9].tolist() == list(range(9))
    # Layer 11 borrowing layer 12's cells: addresses in the cell space, its own first then the borrowed
    assert third.space is space and third.lens_host == [12, 9 - 2 + 3]
    own, other = 2 * SLOTS * 1, 2 * SLOTS * 2
    assert third.cells[1, :10].tolist() == [own + s for s in range(4)] + [other + 40, other + 41, other + 42] + [
        own + s for s in range(6, 9)]
    assert torch.equal(space.keys[third.cells[1, 4]], whole[2, 0, 40]) and torch.equal(
        space.values[third.cells[1, 4]], whole[2, 1, 40])
    assert third.lens.tolist() == third.lens_host


def test_per_head_layers_and_foreign_cells_without_a_cell_space_stay_masked():
    req_to_token = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    per_head = PrefixCells(num_slots=4, own=2, head_own=(2, 3), head_borrowed=((), ()))
    foreign = PrefixCells(num_slots=4, own=2, borrowed=((7, torch.tensor([1])),))
    reads = build_batch_reads([{0: per_head}, {0: foreign}], [5, 6], [0], [8], None, req_to_token, None)
    assert reads.tables == [None, None] and reads.masked == [{0: per_head}, {0: foreign}]


def test_a_per_head_extend_reads_its_queries_head_major_and_attends_exactly():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    whole, space = arena()
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    # Batch row 0 (pool row 1): a child's 3 new tokens after a per-head context of 5 slots (head 0 keeps 3
    # ranks, head 1 keeps 1 and borrows layer 12's head 0 cell 60); batch row 1 (pool row 2): 2 new tokens, plain.
    per_head = PrefixCells(num_slots=5, own=1, head_own=(3, 1), head_borrowed=((), ((12, 0, torch.tensor([60])),)))
    q_lens = [3, 2]
    reads = build_batch_reads([{0: per_head}], [11], [1, 2], [8, 6], q_lens, req_to_token, space)
    table = reads.tables[0]
    assert table.heads == HEADS and table.lens_host == [6, 5, 6, 6]
    assert table.prefix_lens.tolist() == [3, 2, 4, 4] and table.extend_lens.tolist() == [3, 3, 2, 2]
    queries = torch.randn(5, 2 * HEADS, DIM)  # 5 new tokens, two query heads per KV head
    per_head_queries = queries.reshape(5 * HEADS, 2, DIM)[table.order]
    out = torch.empty_like(per_head_queries)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_extend(per_head_queries, out, space.keys.reshape(-1, 1, DIM),
                                     space.values.reshape(-1, 1, DIM), table.cells, torch.arange(4), table.lens,
                                     table.prefix_lens, table.extend_lens, scaling=0.5, enable_gqa=True, causal=True)
    out = torch.empty_like(out).index_copy_(0, table.order, out).reshape(5, 2 * HEADS, DIM)
    layer = whole[1]
    by_hand = {  # (batch row, KV head) -> (its queries' tokens, keys, values, cells before its new tokens)
        (0, 0): (slice(0, 3), torch.cat([layer[0, 16:19, 0], layer[0, 21:24, 0]]),
                 torch.cat([layer[1, 16:19, 0], layer[1, 21:24, 0]]), 3),
        (0, 1): (slice(0, 3), torch.cat([layer[0, 16:17, 1], whole[2, 0, 60:61, 0], layer[0, 21:24, 1]]),
                 torch.cat([layer[1, 16:17, 1], whole[2, 1, 60:61, 0], layer[1, 21:24, 1]]), 2),
        (1, 0): (slice(3, 5), layer[0, 32:38, 0], layer[1, 32:38, 0], 4),
        (1, 1): (slice(3, 5), layer[0, 32:38, 1], layer[1, 32:38, 1], 4),
    }
    for (row, head), (tokens, keys, values, before) in by_hand.items():
        query = queries[tokens, 2 * head : 2 * head + 2].transpose(0, 1)  # [2 query heads, new tokens, D]
        visible = torch.ones(query.shape[1], keys.shape[0], dtype=torch.bool).tril(before)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys[None].expand(2, -1, -1), values[None].expand(2, -1, -1), attn_mask=visible, scale=0.5)
        torch.testing.assert_close(out[tokens, 2 * head : 2 * head + 2], expected.transpose(0, 1))


def test_per_head_cells_in_decode_are_one_list_per_row_and_kv_head_and_attention_through_it_is_exact():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    whole, space = arena()
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    # Row 0 (pool row 1): head 0 keeps 3 own ranks and borrows layer 12's head 1 cells 50, 51; head 1 keeps 1
    # own rank; context of 5 slots, then its tokens. Row 1 (pool row 2) reads its whole row in both heads.
    per_head = PrefixCells(num_slots=5, own=1, head_own=(3, 1),
                           head_borrowed=(((12, 1, torch.tensor([50, 51])),), ()))
    with HostSyncCounter() as counter:
        reads = build_batch_reads([{0: per_head}], [11], [1, 2], [8, 6], None, req_to_token, space)
    assert counter.total == 1 and not any(reads.masked)
    table = reads.tables[0]
    assert table.heads == HEADS and table.lens_host == [3 + 2 + 3, 1 + 3, 6, 6]
    queries = torch.randn(2, 2 * HEADS, DIM)  # two query heads per KV head
    out = torch.empty(2 * HEADS, 2, DIM)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_decode(queries.reshape(2 * HEADS, 2, DIM), out, space.keys.reshape(-1, 1, DIM),
                                     space.values.reshape(-1, 1, DIM), table.cells, torch.arange(4), table.lens,
                                     scaling=0.5, enable_gqa=True)
    layer = whole[1]  # layer 11: [2, SLOTS, H, D]
    reads_by_hand = {  # (batch row, KV head) -> (keys, values)
        (0, 0): (torch.cat([layer[0, 16:19, 0], whole[2, 0, 50:52, 1], layer[0, 21:24, 0]]),
                 torch.cat([layer[1, 16:19, 0], whole[2, 1, 50:52, 1], layer[1, 21:24, 0]])),
        (0, 1): (torch.cat([layer[0, 16:17, 1], layer[0, 21:24, 1]]), torch.cat([layer[1, 16:17, 1], layer[1, 21:24, 1]])),
        (1, 0): (layer[0, 32:38, 0], layer[1, 32:38, 0]), (1, 1): (layer[0, 32:38, 1], layer[1, 32:38, 1]),
    }
    # The extension's table decode (every row in one SDPA call, padding masked), whole and one row per chunk
    from sglang_kvx.adapter.attention import KvxTorchNativeAttnBackend

    ours = KvxTorchNativeAttnBackend.__new__(KvxTorchNativeAttnBackend)
    batched, chunked = torch.empty_like(out), torch.empty_like(out)
    ours._table_decode(queries.reshape(2 * HEADS, 2, DIM), batched, space.keys.reshape(-1, 1, DIM),
                       space.values.reshape(-1, 1, DIM), table, 0.5, True)
    ours.DECODE_GATHER_BYTES = 1  # as a long context would: a chunk of one row
    ours._table_decode(queries.reshape(2 * HEADS, 2, DIM), chunked, space.keys.reshape(-1, 1, DIM),
                       space.values.reshape(-1, 1, DIM), table, 0.5, True)
    for (row, head), (keys, values) in reads_by_hand.items():
        query = queries[row, 2 * head : 2 * head + 2]  # [2, D]
        expected = torch.softmax(query @ keys.T * 0.5, dim=-1) @ values
        torch.testing.assert_close(out[row * HEADS + head], expected)
        torch.testing.assert_close(batched[row * HEADS + head], expected)
        torch.testing.assert_close(chunked[row * HEADS + head], expected)


def test_attention_through_a_table_equals_attention_over_the_cells_gathered_by_hand():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    whole, space = arena()
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    folded = PrefixCells(num_slots=6, own=4, borrowed=((12, torch.tensor([40, 41])),))
    q_lens = [3, 2]
    reads = build_batch_reads([{}, {0: folded}], [10, 11], [1, 3], [9, 5], q_lens, req_to_token, space)
    table = reads.tables[1]
    queries = torch.randn(sum(q_lens), 2 * HEADS, DIM)
    out = torch.empty_like(queries)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_extend(queries, out, space.keys, space.values, table.cells, torch.arange(2), table.lens,
                                     table.prefix_lens, torch.tensor(q_lens), scaling=0.5, enable_gqa=True, causal=True)
    # By hand: row 0 (batch row 1): layer 11's own slots 16..19, layer 12's cells 40, 41, then its tokens 22..24
    keys = torch.cat([whole[1, 0, 16:20], whole[2, 0, 40:42], whole[1, 0, 22:25]])
    values = torch.cat([whole[1, 1, 16:20], whole[2, 1, 40:42], whole[1, 1, 22:25]])
    causal = torch.ones(3, keys.shape[0], dtype=torch.bool).tril(keys.shape[0] - 3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries[:3].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=causal, scale=0.5,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out[:3], expected)
    # Row 1 (pool row 3) reads its whole row in layer 11: slots 48..52 of layer 11
    keys, values = whole[1, 0, 48:53], whole[1, 1, 48:53]
    causal = torch.ones(2, 5, dtype=torch.bool).tril(3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries[3:].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=causal, scale=0.5,
        enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out[3:], expected)


def test_a_graphs_static_tables_list_every_layers_cells_per_row_and_kv_head_with_one_copy():
    """Item 4: a captured decode graph reads static tables (``GraphTables``) filled before each replay. Every
    layer's table is one list per (row, KV head), whatever the batch's tables were: a layer with no table
    (rows read whole), a per-row folded table, a per-head table; each list's keys are gathered by hand."""
    from sglang_kvx.serve.page_tables import GraphTables

    whole, space = arena()
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    rows, seq_lens = [1, 3], [8, 6]
    folded = PrefixCells(num_slots=5, own=3, borrowed=((12, torch.tensor([40, 41])),))
    per_head = PrefixCells(num_slots=5, own=1, head_own=(3, 1), head_borrowed=(((10, 1, torch.tensor([50])),), ()))
    graphs = GraphTables([10, 11, 12], rows=4, width=16, space=space)
    rows_on_device, lens_on_device = torch.tensor(rows), torch.tensor(seq_lens)  # the forward batch's own
    with HostSyncCounter() as counter:
        reads = build_batch_reads([{}, {0: folded}, {0: per_head}], [10, 11, 12], rows, seq_lens, None,
                                  req_to_token, space)
        graphs.fill(reads, rows_on_device, lens_on_device, seq_lens, req_to_token)
    assert counter.total == 1, dict(counter.counts)  # the tables' counts; the fill copies on the device only
    keys = space.keys.reshape(-1, DIM)  # one head per cell

    def expected(layer: int, row: int, head: int) -> torch.Tensor:
        mine = whole[layer - 10, 0]  # [SLOTS, H, D]
        slots = req_to_token[rows[row], : seq_lens[row]].long()
        if row == 1 or layer == 10:
            return mine[slots, head]
        if layer == 11:
            return torch.cat([mine[slots[:3], head], whole[2, 0, 40:42, head], mine[slots[5:], head]])
        if head == 0:
            return torch.cat([mine[slots[:3], 0], whole[0, 0, 50:51, 1], mine[slots[5:], 0]])
        return torch.cat([mine[slots[:1], 1], mine[slots[5:], 1]])

    for index, layer in enumerate([10, 11, 12]):
        table = graphs.layer_table(index, batch=2)
        assert table.heads == HEADS and table.space is space and table.cells.shape == (2 * HEADS, 16)
        for row in range(2):
            for head in range(HEADS):
                at = row * HEADS + head
                torch.testing.assert_close(keys[table.cells[at, : int(table.lens[at])]], expected(layer, row, head))


def test_a_decode_batchs_tables_carried_one_step_equal_tables_built_anew_and_copy_nothing():
    """``TableCarry``: the next decode step's tables, made from the last step's by one cell per list on the
    device, list for list what ``build_batch_reads`` builds from scratch for that step (per-head, folded across
    layers, two layers sharing one table, a plain row beside them), over many steps and past the tables'
    width; anything else about the batch changing makes it build anew."""
    from sglang_kvx.serve.page_tables import TableCarry

    whole, space = arena()
    req_to_token = torch.randperm(4 * 16 * 4).reshape(4, 64)[:, :48].to(torch.int32) % (2 * SLOTS // 2)
    per_head = PrefixCells(num_slots=5, own=1, head_own=(3, 1), head_borrowed=(((12, 1, torch.tensor([50, 51])),), ()))
    folded = PrefixCells(num_slots=6, own=4, borrowed=((12, torch.tensor([40, 41])),))
    ranks = PrefixCells(num_slots=6, own=3, borrowed=())  # the same in layers 10 and 12: one shared table
    masked = [{0: ranks}, {0: per_head, 1: folded}, {0: ranks}]
    # folded (a per-row list across layers) on its own layer, to check its offsets too
    masked_folded = [{0: ranks}, {1: folded}, {0: ranks}]
    rows, rids = [1, 3], ["a", "b"]
    for layers_masked in (masked, masked_folded):
        carry = TableCarry()
        carry.GROW = 3  # grow several times over the steps below
        lens = [9, 7]
        carry.keep(build_batch_reads(layers_masked, [10, 11, 12], rows, lens, None, req_to_token, space),
                   layers_masked, rows, rids, lens, [10, 11, 12])
        for step in range(12):
            lens = [n + 1 for n in lens]
            newest = req_to_token[torch.tensor(rows), torch.tensor(lens) - 1]
            with HostSyncCounter() as counter:
                carried = carry.advance(layers_masked, rows, rids, lens, newest)
            assert carried is not None and counter.total == 0, (step, counter.counts)
            fresh = build_batch_reads(layers_masked, [10, 11, 12], rows, lens, None, req_to_token, space)
            assert carried.tables[0] is carried.tables[2]  # still shared
            for got, want in zip(carried.tables, fresh.tables):
                assert got.lens_host == want.lens_host and got.lens.tolist() == want.lens.tolist()
                assert got.heads == want.heads and got.space is want.space
                for i, count in enumerate(want.lens_host):
                    assert got.cells[i, :count].tolist() == want.cells[i, :count].tolist(), (step, i)
    # What makes it build anew: another request in a row, a length not one longer, other cells, a gap of a step
    lens = [9, 7]
    for change in ("requests", "length", "cells", "skipped"):
        carry = TableCarry()
        carry.keep(build_batch_reads(masked, [10, 11, 12], rows, lens, None, req_to_token, space), masked, rows, rids,
                   lens, [10, 11, 12])
        now_rids, now_lens, now_masked = rids, [10, 8], masked
        if change == "requests":
            now_rids = ["a", "c"]
        elif change == "length":
            now_lens = [10, 9]
        elif change == "cells":
            now_masked = [{0: ranks}, {0: per_head, 1: PrefixCells(num_slots=6, own=4, borrowed=folded.borrowed)}, {0: ranks}]
        else:
            now_lens = [11, 9]
        assert carry.advance(now_masked, rows, now_rids, now_lens, torch.zeros(2, dtype=torch.long)) is None, change
        assert not carry.holding
