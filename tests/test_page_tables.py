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


def test_per_head_layers_and_foreign_cells_without_a_space_stay_masked():
    req_to_token = torch.arange(32, dtype=torch.int32).reshape(2, 16)
    per_head = PrefixCells(num_slots=4, own=2, head_own=(2, 3), head_borrowed=((), ()))
    foreign = PrefixCells(num_slots=4, own=2, borrowed=((7, torch.tensor([1])),))
    reads = build_batch_reads([{0: per_head}, {0: foreign}], [5, 6], [0], [8], None, req_to_token, None)
    assert reads.tables == [None, None] and reads.masked == [{0: per_head}, {0: foreign}]


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
