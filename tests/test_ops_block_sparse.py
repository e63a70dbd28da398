"""Block-sparse attention ops (``ops/block_sparse.py``) against brute force.

Compressed keys against a hand-made mean; the indexer's block choice checked by hand on small
shapes; attention over the chosen blocks against ``F.scaled_dot_product_attention`` over the same
tokens gathered by hand; with a budget as large as the context, dense causal attention exactly.
The Triton kernels against the references under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_kvx.ops.block_sparse import (
    BLOCK,
    block_sparse_attention,
    compress_blocks,
    row_blocks,
    select_blocks,
)

from interpreter import interpreted_lines


def random_row(seed: int, n: int = 29, heads: int = 4, kv_heads: int = 2, dim: int = 8, queries: int = 6) -> dict:
    """One row of ``n`` entries scattered over a pool, its blocks in position order, and its last
    ``queries`` positions as queries (a prefill chunk; the last one is a decode step's query)."""
    gen = torch.Generator().manual_seed(seed)
    pool = n + 11
    slots = torch.randperm(pool - 1, generator=gen)[:n] + 1
    block_slots, block_positions = row_blocks(slots)
    q_positions = torch.arange(n - queries, n)
    return dict(
        q=torch.randn(queries, heads, dim, generator=gen),
        k_cache=torch.randn(pool, kv_heads, dim, generator=gen),
        v_cache=torch.randn(pool, kv_heads, dim, generator=gen),
        slots=slots, block_slots=block_slots, block_positions=block_positions, q_positions=q_positions,
        block_from=torch.zeros(queries, dtype=torch.long), block_to=q_positions // BLOCK + 1, scaling=dim ** -0.5,
    )


def test_row_blocks_and_compressed_keys_are_block_means() -> None:
    case = random_row(0)
    assert case["block_slots"].shape == (8, BLOCK)  # ceil(29 / 4)
    assert case["block_slots"][-1].tolist()[1:] == [-1, -1, -1]  # the partial last block
    got = compress_blocks(case["k_cache"], case["block_slots"])
    for b in range(8):
        entries = case["slots"][b * BLOCK : (b + 1) * BLOCK]
        assert torch.allclose(got[b], case["k_cache"][entries].mean(0), atol=1e-6)


def test_the_indexer_picks_sinks_the_local_block_and_the_best_others_by_hand() -> None:
    # One KV head, one query head, dim 2; block b's keys all equal (b_score, 0) so its compressed
    # key is exactly that: the query (1, 0) scores block b by b_score.
    block_scores = [0.0, 5.0, -1.0, 3.0, 9.0, 2.0, -4.0, 1.0]
    k_cache = torch.zeros(1 + 8 * BLOCK, 1, 2)
    for b, score in enumerate(block_scores):
        k_cache[1 + b * BLOCK : 1 + (b + 1) * BLOCK, 0, 0] = score
    slots = torch.arange(1, 1 + 8 * BLOCK)
    block_slots, _ = row_blocks(slots)
    keys = compress_blocks(k_cache, block_slots)
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[1.0, 0.0]]])
    # Query 0 sees blocks 0..6 (its own: 6); query 1 sees 0..2 only; query 2 sees 0..7.
    block_from, block_to = torch.tensor([0, 0, 0]), torch.tensor([7, 3, 8])
    chosen = select_blocks(q, keys, block_from, block_to, budget_blocks=4, sink_blocks=1, scaling=1.0)
    assert chosen[0, 0].tolist() == [0, 1, 4, 6]  # sink 0, local 6, best others 4 (9.0), 1 (5.0)
    assert chosen[1, 0].tolist() == [0, 1, 2, -1]  # fewer visible blocks than the budget: all of them
    assert chosen[2, 0].tolist() == [0, 1, 4, 7]  # local 7; then 4 (9.0) and 1 (5.0)
    with pytest.raises(ValueError, match="sink blocks and the local one"):
        select_blocks(q, keys, block_from, block_to, budget_blocks=1, sink_blocks=1, scaling=1.0)


def test_the_indexer_sums_a_kv_heads_query_group() -> None:
    case = random_row(1)
    keys = compress_blocks(case["k_cache"], case["block_slots"])
    chosen = select_blocks(case["q"], keys, case["block_from"], case["block_to"], budget_blocks=4, sink_blocks=1,
                           scaling=case["scaling"])
    for n in range(case["q"].shape[0]):
        local = int(case["block_to"][n]) - 1
        for h in range(2):
            grouped = case["q"][n, 2 * h] + case["q"][n, 2 * h + 1]
            scores = keys[1:local, h] @ grouped  # the blocks between the sink and the local one
            best = (scores.topk(2).indices + 1).tolist()
            assert chosen[n, h].tolist() == sorted([0, local, *best])


@pytest.mark.parametrize("budget_blocks", [3, 5])
def test_attention_over_the_chosen_blocks_is_sdpa_over_those_tokens(budget_blocks) -> None:
    case = random_row(2)
    keys = compress_blocks(case["k_cache"], case["block_slots"])
    chosen = select_blocks(case["q"], keys, case["block_from"], case["block_to"], budget_blocks, 1, case["scaling"])
    got = block_sparse_attention(case["q"], case["k_cache"], case["v_cache"], case["block_slots"],
                                 case["block_positions"], chosen, case["q_positions"], case["scaling"])
    for n in range(case["q"].shape[0]):
        for head in range(4):
            kv_head = head // 2
            positions = [4 * b + e for b in chosen[n, kv_head].tolist() if b >= 0 for e in range(BLOCK)
                         if 4 * b + e <= int(case["q_positions"][n])]
            entries = case["slots"][positions]
            k = case["k_cache"][entries, kv_head][None, None]
            v = case["v_cache"][entries, kv_head][None, None]
            want = F.scaled_dot_product_attention(case["q"][n, head][None, None, None], k, v, scale=case["scaling"])
            assert torch.allclose(got[n, head], want[0, 0, 0], atol=1e-5)
    assert (chosen >= 0).sum(-1).max() == budget_blocks  # the budget bites at this length


def test_a_budget_as_large_as_the_context_is_dense_causal_attention(monkeypatch) -> None:
    from sglang_kvx.ops import block_sparse

    monkeypatch.setattr(block_sparse, "QUERY_CHUNK", 4)  # the reference's query chunks, over 9 queries
    case = random_row(3, n=37, queries=9)
    keys = compress_blocks(case["k_cache"], case["block_slots"])
    chosen = select_blocks(case["q"], keys, case["block_from"], case["block_to"], budget_blocks=10, sink_blocks=1,
                           scaling=case["scaling"])
    got = block_sparse_attention(case["q"], case["k_cache"], case["v_cache"], case["block_slots"],
                                 case["block_positions"], chosen, case["q_positions"], case["scaling"])
    k = case["k_cache"][case["slots"]].repeat_interleave(2, 1).transpose(0, 1)  # [Hq, n, D]
    v = case["v_cache"][case["slots"]].repeat_interleave(2, 1).transpose(0, 1)
    mask = torch.arange(37)[None, :] <= case["q_positions"][:, None]  # [queries, n]
    want = F.scaled_dot_product_attention(case["q"].transpose(0, 1), k, v, attn_mask=mask, scale=case["scaling"])
    assert torch.allclose(got, want.transpose(0, 1), atol=1e-6)


def test_a_decode_batch_scores_each_row_against_its_own_blocks_only() -> None:
    # Three decode rows of different lengths, their blocks one after another (as the server lays
    # them out): scored together, each row's choice is the one it gets alone, and no row reads
    # another's blocks (row 1's blocks are made the best of all, so a leak would pick them).
    gen = torch.Generator().manual_seed(11)
    lengths = [9, 4, 13]  # blocks per row
    keys = torch.randn(sum(lengths), 2, 8, generator=gen)
    keys[9:13] *= 50.0
    q = torch.randn(3, 4, 8, generator=gen).abs()
    keys[9:13] = keys[9:13].abs()
    block_from = torch.tensor([0, 9, 13])
    block_to = block_from + torch.tensor(lengths)
    together = select_blocks(q, keys, block_from, block_to, budget_blocks=4, sink_blocks=1, scaling=0.3)
    for n in range(3):
        alone = select_blocks(q[n : n + 1], keys, block_from[n : n + 1], block_to[n : n + 1], budget_blocks=4,
                              sink_blocks=1, scaling=0.3)
        assert torch.equal(together[n], alone[0])
        chosen = together[n][together[n] >= 0]
        assert bool(((chosen >= block_from[n]) & (chosen < block_to[n])).all())
    # Brute force for row 2: sink, local, then its two best middle blocks by the group's summed query.
    for h in range(2):
        grouped = q[2, 2 * h] + q[2, 2 * h + 1]
        best = ((keys[14:25, h] @ grouped).topk(2).indices + 14).tolist()
        assert together[2, h].tolist() == sorted([13, 25, *best])


def with_extra_cells(case: dict, moved: int = 9) -> dict:
    """The same row with its entries from index 10 on moved out of the pool into extra cells
    (as a compacted layer's borrowed cells): slots P + j name extra row j."""
    pool = case["k_cache"].shape[0]
    slots = case["slots"].clone()
    picked = slots[10 : 10 + moved]
    extra_k, extra_v = case["k_cache"][picked].clone(), case["v_cache"][picked].clone()
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    k_cache[picked], v_cache[picked] = 1e3, -1e3  # garbage where they were: must not be read
    slots[10 : 10 + moved] = pool + torch.arange(moved)
    block_slots, block_positions = row_blocks(slots)
    return {**case, "k_cache": k_cache, "v_cache": v_cache, "slots": slots, "block_slots": block_slots,
            "block_positions": block_positions, "extra_keys": extra_k, "extra_values": extra_v}


def test_extra_cells_read_as_the_pool_cells_they_replace() -> None:
    case = random_row(7)
    moved = with_extra_cells(case)
    keys = compress_blocks(case["k_cache"], case["block_slots"])
    moved_keys = compress_blocks(moved["k_cache"], moved["block_slots"], extra_keys=moved["extra_keys"])
    assert torch.allclose(keys, moved_keys, atol=1e-6)
    chosen = select_blocks(case["q"], keys, case["block_from"], case["block_to"], 4, 1, case["scaling"])
    want = block_sparse_attention(case["q"], case["k_cache"], case["v_cache"], case["block_slots"],
                                  case["block_positions"], chosen, case["q_positions"], case["scaling"])
    got = block_sparse_attention(moved["q"], moved["k_cache"], moved["v_cache"], moved["block_slots"],
                                 moved["block_positions"], chosen, moved["q_positions"], moved["scaling"],
                                 extra_keys=moved["extra_keys"], extra_values=moved["extra_values"])
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.gpu
def test_the_cupy_compression_matches_the_reference() -> None:
    from sglang_kvx.ops.dispatch import cupy_available

    if not cupy_available():
        pytest.skip("cupy with a CUDA device is not available (the optional 'gpu' extra)")
    case = with_extra_cells(random_row(8))
    k_cache, slots, extra = case["k_cache"].cuda(), case["block_slots"].cuda(), case["extra_keys"].cuda()
    want = compress_blocks(k_cache, slots, impl="torch", extra_keys=extra)
    got = compress_blocks(k_cache, slots, impl="cupy", extra_keys=extra)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing flashinfer's CuTe kernels
def test_flashinfer_path_plumbing_with_a_stand_in(monkeypatch) -> None:
    """One batch decode per KV head, each query's chosen cells its page list: equals the reference
    (FlashInfer's calls bound to the installed package's signatures, computed by a torch stand-in)."""
    import inspect

    from test_ops_window_attention import _StandInDecodeWrapper

    from sglang_kvx.ops.flashinfer_block_sparse import block_sparse_attention_flashinfer
    from sglang_kvx.ops.flashinfer_plans import DecodePlans

    try:
        import flashinfer

        _StandInDecodeWrapper.real = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        inspect.signature(flashinfer.BatchDecodeWithPagedKVCacheWrapper.run)
    except ImportError:
        _StandInDecodeWrapper.real = None
    stand_in = type(sys)("flashinfer")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = _StandInDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    plans = DecodePlans(workspace_bytes=16)
    case = random_row(9, n=45, queries=7)
    keys = compress_blocks(case["k_cache"], case["block_slots"])
    chosen = select_blocks(case["q"], keys, case["block_from"], case["block_to"], 4, 1, case["scaling"])
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_slots"], case["block_positions"], chosen,
            case["q_positions"], case["scaling"])
    got = block_sparse_attention_flashinfer(*args, plans=plans)
    assert torch.allclose(got, block_sparse_attention(*args, impl="torch"), atol=1e-5)
    assert plans.plan_count == 1  # one plan for every (query, KV head) pair, not one per KV head


def test_bad_dispatch_is_refused(monkeypatch) -> None:
    case = random_row(4)
    with pytest.raises(RuntimeError, match="needs cupy"):
        compress_blocks(case["k_cache"], case["block_slots"], impl="cupy")  # CPU tensors
    chosen = torch.zeros((case["q"].shape[0], 2, 1), dtype=torch.long)
    with pytest.raises(RuntimeError, match="FlashInfer block sparse attention needs"):
        block_sparse_attention(case["q"], case["k_cache"], case["v_cache"], case["block_slots"], case["block_positions"],
                               chosen, case["q_positions"], case["scaling"], impl="flashinfer")
    with pytest.raises(ValueError, match="block_select: impl must be one of auto, triton, torch; got 'cupy'"):
        select_blocks(case["q"], compress_blocks(case["k_cache"], case["block_slots"]), case["block_from"],
                      case["block_to"], 4, 1, case["scaling"], impl="cupy")
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "cuda")
    with pytest.raises(ValueError, match="SGLANG_KVX_OPS_IMPL"):
        compress_blocks(case["k_cache"], case["block_slots"])
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "block_compress=flashinfer")
    with pytest.raises(ValueError, match="block_compress offers cupy, triton, torch"):
        compress_blocks(case["k_cache"], case["block_slots"])
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "block_compress=cupy")  # asked for by the environment: CPU tensors
    with pytest.raises(RuntimeError, match="needs cupy"):
        compress_blocks(case["k_cache"], case["block_slots"])
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "cupy")  # bare: only the ops offering it; select runs its own auto
    select_blocks(case["q"], compress_blocks(case["k_cache"], case["block_slots"], impl="torch"), case["block_from"],
                  case["block_to"], 4, 1, case["scaling"])
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "")
    monkeypatch.setenv("SGLANG_KVX_BLOCK_SPARSE_IMPL", "torch")  # retired: said so, not ignored
    with pytest.raises(ValueError, match="replaced by SGLANG_KVX_OPS_IMPL"):
        compress_blocks(case["k_cache"], case["block_slots"])


def test_triton_kernels_match_the_references_under_the_interpreter() -> None:
    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_ops_block_sparse import random_row\n"
        "from sglang_kvx.ops.block_sparse import block_sparse_attention, compress_blocks, select_blocks\n"
        "for seed, n, queries in ((5, 29, 6), (6, 50, 1)):\n"
        "    c = random_row(seed, n=n, queries=queries)\n"
        "    keys = {impl: compress_blocks(c['k_cache'], c['block_slots'], impl=impl) for impl in ('torch', 'triton')}\n"
        "    print('compress', float((keys['torch'] - keys['triton']).abs().max()))\n"
        "    chosen = {impl: select_blocks(c['q'], keys['torch'], c['block_from'], c['block_to'], 4, 1, c['scaling'],\n"
        "                                  impl=impl) for impl in ('torch', 'triton')}\n"
        "    print('select', int((chosen['torch'] != chosen['triton']).sum()))\n"
        "    spans = (c['block_from'].tolist(), (c['block_to'] - c['block_from']).tolist())  # a BlockPlan's host lists\n"
        "    planned = select_blocks(c['q'], keys['torch'], c['block_from'], c['block_to'], 4, 1, c['scaling'],\n"
        "                            impl='triton', spans=spans)\n"
        "    print('select_spans', int((chosen['torch'] != planned).sum()))\n"
        "    out = {impl: block_sparse_attention(c['q'], c['k_cache'], c['v_cache'], c['block_slots'],\n"
        "                                        c['block_positions'], chosen['torch'], c['q_positions'], c['scaling'],\n"
        "                                        impl=impl) for impl in ('torch', 'triton')}\n"
        "    print('attention', float((out['torch'] - out['triton']).abs().max()))\n"
        "from test_ops_block_sparse import with_extra_cells\n"
        "m = with_extra_cells(random_row(7))\n"
        "keys = {impl: compress_blocks(m['k_cache'], m['block_slots'], impl=impl, extra_keys=m['extra_keys'])\n"
        "        for impl in ('torch', 'triton')}\n"
        "print('compress_extra', float((keys['torch'] - keys['triton']).abs().max()))\n"
        "chosen = select_blocks(m['q'], keys['torch'], m['block_from'], m['block_to'], 4, 1, m['scaling'])\n"
        "out = {impl: block_sparse_attention(m['q'], m['k_cache'], m['v_cache'], m['block_slots'], m['block_positions'],\n"
        "                                    chosen, m['q_positions'], m['scaling'], impl=impl, extra_keys=m['extra_keys'],\n"
        "                                    extra_values=m['extra_values']) for impl in ('torch', 'triton')}\n"
        "print('attention_extra', float((out['torch'] - out['triton']).abs().max()))\n"
    )
    lines = interpreted_lines(code)
    assert len(lines) == 10, lines
    for line in lines:
        name, err = line.split()
        assert float(err) < 1e-5, line


def test_a_batch_planned_once_attends_as_planned_per_call_and_reads_nothing_back() -> None:
    """Issue #56: the block layout is planned once per forward batch (``plan_blocks``, from host lengths) and
    every layer reading the same rows reuses it; with the plan, a decode step of two rows (one with known
    compressed keys from an earlier step) computes what the unplanned call computes, with no host sync."""
    from sglang_kvx.ops.block_sparse import paged_block_sparse_attention, plan_blocks
    from sglang_kvx.ops.host_syncs import HostSyncCounter

    first, second = random_row(3, n=29, queries=1), random_row(4, n=22, queries=1)
    k_cache = torch.cat([first["k_cache"], second["k_cache"]])
    v_cache = torch.cat([first["v_cache"], second["v_cache"]])
    row_keys = [first["slots"], second["slots"] + first["k_cache"].shape[0]]
    q = torch.cat([first["q"], second["q"]])
    known = [compress_blocks(k_cache, row_blocks(row_keys[0])[0])[:5], None]  # row 0: its first 5 blocks built before
    unplanned, unplanned_keys = paged_block_sparse_attention(q, k_cache, v_cache, row_keys, [1, 1], 3, 1, 0.4,
                                                             known_block_keys=known)
    with HostSyncCounter() as counter:
        plan = plan_blocks(row_keys, [1, 1], q.device)
        planned, planned_keys = paged_block_sparse_attention(q, k_cache, v_cache, row_keys, [1, 1], 3, 1, 0.4,
                                                             known_block_keys=known, plan=plan)
    assert counter.total == 0, dict(counter.counts)
    assert plan.row_blocks == [8, 6] and plan.spans == ([0, 8], [8, 6])
    torch.testing.assert_close(planned, unplanned)
    assert all(torch.equal(a, b) for a, b in zip(planned_keys, unplanned_keys))
    # The same attention from the ops, the layout built by hand and the spans read from the device
    (slots0, positions0), (slots1, positions1) = row_blocks(row_keys[0]), row_blocks(row_keys[1])
    block_keys = compress_blocks(k_cache, torch.cat([slots0, slots1]))
    chosen = select_blocks(q, block_keys, torch.tensor([0, 8]), torch.tensor([8, 14]), 3, 1, 0.4)
    by_hand = block_sparse_attention(q, k_cache, v_cache, torch.cat([slots0, slots1]), torch.cat([positions0, positions1]),
                                     chosen, torch.tensor([28, 21]), 0.4)
    torch.testing.assert_close(planned, by_hand)
