"""Block-sparse attention over SGLang's paged KV: compressed block keys, the indexer's block
selection, and exact attention over the selected blocks (issue 17; GateSight's seed Sec. 5.4 and
App. H, where a sparse cache indexes one compressed key per four-token block).

A **block** is up to ``BLOCK`` (4) cache entries, named by their pool slots: ``block_slots [NB, 4]``
(-1 pads a partial block) with each entry's position ``block_positions [NB, 4]`` (causality). A
row's blocks in position order are consecutive runs of ``req_to_token``; after compaction the kept
entries of each KV head, already a dense run of rank slots, are regrouped into new blocks the
same way (QSA), so the index shrinks from n/4 to about p*n/4 blocks.

1. ``compress_blocks``: a block's compressed key per KV head is the **mean of its keys** (as
   cached, after RoPE). Training-free: q . mean(k) is the mean of the block's logits q . k, so the
   indexer ranks blocks by their average attention logit, which a model trained without an indexer
   already gives meaning to (NSA and DSA learn a compression and an indexer instead; we have no
   sparse-trained checkpoint to learn them from).
2. ``select_blocks``: per query and KV head, the indexer scores every block the query may see
   (``block_from[n] <= b < block_to[n]``; the last one is the query's own, local block) by the sum
   over the head's query group of ``scaling * q . c_b``, and keeps the first ``sink_blocks`` and the
   local block plus the best others, ``budget_blocks`` in all. Returns global block ids
   ``[N, Hkv, budget_blocks]`` in ascending order, -1 padded when fewer blocks are visible.
3. ``block_sparse_attention``: exact softmax attention of each query head over the entries of its
   KV head's selected blocks with ``position <= q_position``.

A slot at or past the pool's size P names row ``slot - P`` of ``extra_keys`` / ``extra_values``: the
cells a compacted layer borrowed from other layers' buffers (``compact/layout.py``), gathered once
per forward, so a regrouped child's blocks may span both.

Each op has a torch reference (the source of truth) and a Triton kernel, chosen by the kernel
layer's one dispatch (``ops/dispatch.py``: ops ``block_compress``, ``block_select``,
``block_sparse_attention``; auto: Triton on CUDA; the block compression runs a CuPy kernel where
CuPy imports, ``ops/cupy_block_sparse.py``, and the attention FlashInfer's batch decode where it
imports, ``ops/flashinfer_block_sparse.py``: SGLang's pool is a paged cache of page size 1, so the
chosen blocks' cells are each query's page list; both untested on a GPU here).
Math in float32; outputs in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvx.ops.block_layout import BLOCK
from sglang_kvx.ops.dispatch import choose, run, where_offered
from sglang_kvx.ops.flashinfer_plans import DecodePlans, flashinfer_shapes

__all__ = ["BLOCK", "BlockPlan", "block_sparse_attention", "compress_blocks", "paged_block_sparse_attention",
           "plan_blocks", "row_blocks", "select_blocks"]


def row_blocks(slots: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group a run of entries (pool ``slots`` [n], in order) into blocks of ``BLOCK``: (block_slots,
    block_positions), each [ceil(n / 4), 4], -1 padded. ``positions`` default to 0 .. n - 1."""
    n = slots.numel()
    if positions is None:
        positions = torch.arange(n, device=slots.device)
    padded = -(-n // BLOCK) * BLOCK
    block_slots = torch.full((padded,), -1, dtype=torch.long, device=slots.device)
    block_positions = torch.full((padded,), -1, dtype=torch.long, device=slots.device)
    block_slots[:n] = slots.long()
    block_positions[:n] = positions.long()
    return block_slots.view(-1, BLOCK), block_positions.view(-1, BLOCK)


def _gather(cache: torch.Tensor, extra: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] in float32, slots at or past the pool's size read from ``extra`` (-1: zeros)."""
    slots = slots.clamp(min=0)
    pool = cache.shape[0]
    out = cache[slots.clamp(max=pool - 1)].float()
    if extra is not None and extra.numel():
        outside = slots >= pool
        out[outside] = extra[slots[outside] - pool].float()
    return out


def _gather_heads(cache: torch.Tensor, extra: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """[..., Hkv, E, D] float32: each KV head's own row of the entries ``slots`` [..., Hkv, E]."""
    head = torch.arange(cache.shape[1], device=slots.device)[:, None].expand(slots.shape[-2:]).expand_as(slots)
    slots = slots.clamp(min=0)
    pool = cache.shape[0]
    out = cache[slots.clamp(max=pool - 1), head].float()
    if extra is not None and extra.numel():
        outside = slots >= pool
        out[outside] = extra[slots[outside] - pool, head[outside]].float()
    return out


def compress_blocks_reference(k_cache: torch.Tensor, block_slots: torch.Tensor,
                              extra_keys: torch.Tensor | None = None) -> torch.Tensor:
    """[NB, Hkv, D] float32: the mean key of each block's entries, per KV head."""
    valid = block_slots >= 0  # [NB, 4]
    keys = _gather(k_cache, extra_keys, block_slots)  # [NB, 4, Hkv, D]
    keys = keys * valid[:, :, None, None]
    return keys.sum(1) / valid.sum(1).clamp(min=1)[:, None, None]


def compress_blocks(k_cache: torch.Tensor, block_slots: torch.Tensor, impl: str | None = None,
                    extra_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch (op ``block_compress``): CuPy on CUDA where it imports (else Triton on CUDA), the reference elsewhere."""

    def cupy(*args):
        from sglang_kvx.ops.cupy_block_sparse import compress_blocks_cupy

        return compress_blocks_cupy(*args)

    def triton(*args):
        from sglang_kvx.ops.triton_block_sparse import compress_blocks_triton

        return compress_blocks_triton(*args)

    return run("block_compress", impl, choose("block_compress", impl, k_cache.device), compress_blocks_reference,
               {"cupy": cupy, "triton": triton}, k_cache, block_slots, extra_keys)


def block_scores_reference(q: torch.Tensor, block_keys: torch.Tensor, block_from: torch.Tensor,
                           block_to: torch.Tensor, scaling: float,
                           spans: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """[N, Hkv, W] the indexer's score of each query's visible blocks ``block_from[n] + w`` (W the
    widest span; -inf past a query's own), summed over each KV head's query group. Queries sharing
    a ``block_from`` (one row's) are scored against that row's blocks in one product; what a query
    may not see is masked once for the batch, so a row costs one product (a decode step's scan
    grows with the blocks it reads, not with per-row bookkeeping). ``spans``: ``block_from`` and
    ``block_to - block_from`` as the caller knows them on the host (else read back from the device)."""
    num_q, num_heads, _ = q.shape
    kv_heads = block_keys.shape[1]
    visible_blocks = block_to - block_from
    starts, counts = spans if spans is not None else (block_from.tolist(), visible_blocks.tolist())
    width = max(counts, default=0)
    grouped = q.float().view(num_q, kv_heads, num_heads // kv_heads, -1).sum(2).mul_(scaling)
    scores = torch.empty((num_q, kv_heads, width), dtype=torch.float32, device=q.device)
    run = 0
    while run < num_q:  # runs of queries with one block_from
        end, span = run, 0
        while end < num_q and starts[end] == starts[run]:
            span = max(span, counts[end])
            end += 1
        keys = block_keys[starts[run] : starts[run] + span].float()  # [span, Hkv, D]
        scores[run:end, :, :span] = torch.einsum("nhd,whd->nhw", grouped[run:end], keys)
        run = end
    hidden = torch.arange(width, device=q.device)[None, :] >= visible_blocks[:, None]
    return scores.masked_fill_(hidden[:, None, :], float("-inf"))


def _pick(scores: torch.Tensor, block_from: torch.Tensor, block_to: torch.Tensor, budget_blocks: int,
          sink_blocks: int) -> torch.Tensor:
    """Sinks and the local block forced, then the best scores, ``budget_blocks`` in all, ascending ids."""
    num_q, kv_heads, width = scores.shape
    span = (block_to - block_from).long()
    w = torch.arange(width, device=scores.device)
    forced = (w[None, :] < min(sink_blocks, budget_blocks)) | (w[None, :] == span[:, None] - 1)  # [N, W]
    visible = w[None, :] < span[:, None]
    ranked = scores.masked_fill(forced[:, None, :] & visible[:, None, :], float("inf"))
    k = min(budget_blocks, width)
    top = ranked.topk(k, dim=-1)
    chosen = torch.where(top.values > float("-inf"), top.indices + block_from[:, None, None].long(), -1)
    chosen = chosen.masked_fill(chosen < 0, torch.iinfo(torch.long).max).sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == torch.iinfo(torch.long).max, -1)
    if k < budget_blocks:
        chosen = torch.cat([chosen, chosen.new_full((num_q, kv_heads, budget_blocks - k), -1)], dim=-1)
    return chosen


def select_blocks(q: torch.Tensor, block_keys: torch.Tensor, block_from: torch.Tensor, block_to: torch.Tensor,
                  budget_blocks: int, sink_blocks: int, scaling: float, impl: str | None = None,
                  max_span: int | None = None, spans: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """[N, Hkv, budget_blocks] the blocks each query's KV head attends to (see the module doc). ``max_span``:
    a bound on ``block_to - block_from`` the caller knows on the host (else read from the device once);
    ``spans``: ``block_from`` and ``block_to - block_from`` on the host (a ``BlockPlan``'s): nothing is read back."""
    if budget_blocks < sink_blocks + 1:
        raise ValueError(f"budget_blocks must hold the {sink_blocks} sink blocks and the local one, got {budget_blocks}")
    if (min(spans[1], default=1) < 1) if spans is not None else bool((block_to <= block_from).any()):
        raise ValueError("every query must see at least its own block")

    def triton(*args):
        from sglang_kvx.ops.triton_block_sparse import block_scores_triton

        return block_scores_triton(*args)

    chosen = []
    num_q = block_from.shape[0]
    if max_span is None:
        max_span = max(spans[1], default=0) if spans is not None else int((block_to - block_from).max()) if num_q else 0
    for q0, q1 in _score_tiles(num_q, max_span, block_keys.shape[1]):
        tile = (spans[0][q0:q1], spans[1][q0:q1]) if spans is not None else None
        scores = run("block_select", impl, choose("block_select", impl, q.device), block_scores_reference,
                     {"triton": triton}, q[q0:q1], block_keys, block_from[q0:q1], block_to[q0:q1], scaling, tile)
        chosen.append(_pick(scores, block_from[q0:q1], block_to[q0:q1], budget_blocks, sink_blocks))
    return torch.cat(chosen) if len(chosen) != 1 else chosen[0]


SCORE_TILE_BYTES = 64 << 20  # the indexer's [queries, Hkv, blocks] float32 scores, per tile of queries


def _score_tiles(num_q: int, width: int, kv_heads: int) -> list[tuple[int, int]]:
    """Query ranges whose scores (``width`` blocks at most per query) fit SCORE_TILE_BYTES: a prefill chunk
    of 8K queries over 128K keys scored whole was [8192, Hkv, 32768] float32 (8.6 GB at 8 KV heads)."""
    per_query = max(1, kv_heads * width * 4 * 3)  # the scores, the ranked copy and topk's working set
    step = max(1, SCORE_TILE_BYTES // per_query)
    return [(q0, min(num_q, q0 + step)) for q0 in range(0, num_q, step)] or [(0, 0)]


QUERY_CHUNK = 256  # queries per step of the reference: bounded [chunk, Hkv, budget, D] gathers


def block_sparse_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_slots: torch.Tensor, block_positions: torch.Tensor,
                                     selected: torch.Tensor, q_positions: torch.Tensor, scaling: float,
                                     extra_keys: torch.Tensor | None = None,
                                     extra_values: torch.Tensor | None = None) -> torch.Tensor:
    num_q, num_heads, _ = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    out = q.new_empty((num_q, num_heads, v_cache.shape[-1]))
    for start in range(0, num_q, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, num_q)
        chosen = selected[start:end]
        ids = chosen.clamp(min=0)  # [n, Hkv, K]
        slots = block_slots[ids].flatten(2)  # [n, Hkv, K * 4]
        positions = block_positions[ids].flatten(2)
        visible = (chosen >= 0).repeat_interleave(BLOCK, dim=-1) & (slots >= 0) & (positions <= q_positions[start:end, None, None])
        keys = _gather_heads(k_cache, extra_keys, slots)  # [n, Hkv, K * 4, D], shared by the head's query group
        values = _gather_heads(v_cache, extra_values, slots)
        queries = q[start:end].float().view(end - start, kv_heads, group, -1)
        z = torch.einsum("nhgd,nhkd->nhgk", queries, keys) * scaling
        a = torch.softmax(z.masked_fill(~visible[:, :, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        out[start:end] = torch.einsum("nhgk,nhkd->nhgd", a, values).reshape(end - start, num_heads, -1).to(q.dtype)
    return out


def block_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_slots: torch.Tensor,
                           block_positions: torch.Tensor, selected: torch.Tensor, q_positions: torch.Tensor,
                           scaling: float, impl: str | None = None, extra_keys: torch.Tensor | None = None,
                           extra_values: torch.Tensor | None = None, plans: DecodePlans | None = None) -> torch.Tensor:
    """[N, Hq, Dv]: each query head over its KV head's selected blocks (entries at or before it).
    Dispatch (op ``block_sparse_attention``): FlashInfer on CUDA where it imports and takes the
    shapes (cells in the pool only; ``plans``: the forward batch's wrappers), else Triton on CUDA,
    else the reference."""
    in_pool = extra_keys is None or extra_keys.numel() == 0

    def supports(name: str) -> str | None:
        if name != "flashinfer":
            return None
        return flashinfer_shapes(q, k_cache, v_cache) or (None if in_pool else "every cell in the pool")

    def flashinfer(*args):
        from sglang_kvx.ops.flashinfer_block_sparse import block_sparse_attention_flashinfer

        # It reads cells in the pool only (supports): the extra keys and values are empty.
        return block_sparse_attention_flashinfer(*args[:8], plans if plans is not None else DecodePlans())

    def triton(*args):
        from sglang_kvx.ops.triton_block_sparse import block_sparse_attention_triton

        return block_sparse_attention_triton(*args)

    return run("block_sparse_attention", impl, choose("block_sparse_attention", impl, q.device, supports),
               block_sparse_attention_reference, {"flashinfer": flashinfer, "triton": triton}, q, k_cache, v_cache,
               block_slots, block_positions, selected, q_positions, scaling, extra_keys, extra_values)


@dataclass(frozen=True)
class BlockPlan:
    """Rows' entries grouped into blocks of four, planned once per forward batch for every layer whose rows
    read the same entries (``plan_blocks``); what the host knows of it stays on the host."""

    block_slots: torch.Tensor  # [NB, 4] the rows' blocks, row after row, -1 padded
    block_positions: torch.Tensor  # [NB, 4] each entry's position in its row
    block_from: torch.Tensor  # [N] each query's row's first block
    block_to: torch.Tensor  # [N] one past the last block each query sees
    q_positions: torch.Tensor  # [N] each query's position in its row
    row_blocks: list[int]  # blocks per row
    spans: tuple[list[int], list[int]]  # ``block_from`` and ``block_to - block_from``, on the host


def plan_blocks(row_keys: list[torch.Tensor], q_lens: list[int], device: torch.device) -> BlockPlan:
    """The block layout of rows whose keys are ``row_keys[b]`` (entries in order) and whose last ``q_lens[b]``
    are the queries. Lengths are host shapes: nothing is read back."""
    slots, positions, block_from, block_to, q_positions, blocks_per_row = [], [], [], [], [], []
    starts, counts = [], []
    offset = 0
    for keys, q_len in zip(row_keys, q_lens):
        length = keys.numel()
        block_slots, block_positions = row_blocks(keys.to(device))
        slots.append(block_slots)
        positions.append(block_positions)
        query_positions = torch.arange(length - q_len, length, device=device)
        q_positions.append(query_positions)
        block_from.append(torch.full((q_len,), offset, dtype=torch.long, device=device))
        block_to.append(offset + query_positions // BLOCK + 1)
        starts += [offset] * q_len
        counts += [p // BLOCK + 1 for p in range(length - q_len, length)]
        blocks_per_row.append(block_slots.shape[0])
        offset += block_slots.shape[0]
    return BlockPlan(torch.cat(slots), torch.cat(positions), torch.cat(block_from), torch.cat(block_to),
                     torch.cat(q_positions), blocks_per_row, (starts, counts))


def paged_block_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 row_keys: list[torch.Tensor], q_lens: list[int], budget_blocks: int, sink_blocks: int,
                                 scaling: float, impl: str | None = None, extra_keys: torch.Tensor | None = None,
                                 extra_values: torch.Tensor | None = None,
                                 known_block_keys: list[torch.Tensor | None] | None = None,
                                 plans: DecodePlans | None = None,
                                 plan: BlockPlan | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Block-sparse attention for a batch of rows: row b's keys are the entries ``row_keys[b]``
    (slots, in order: a plain row's ``req_to_token[row, :seq_len]``; a child's kept entries of the
    layer, then its own), grouped into blocks of four in that order, its last ``q_lens[b]`` the
    queries (q [sum q_lens, Hq, D], row after row). ``known_block_keys[b]``: compressed keys of the
    row's first blocks from an earlier call (their entries unchanged); only the rest are built.
    ``plan``: ``plan_blocks(row_keys, q_lens)`` made once for the batch (else made here).
    Returns the output and each row's compressed keys, all its blocks (the last may be partial).
    ``impl`` steers each of the three ops that offers it (the others choose their own, as auto)."""
    if plan is None:
        plan = plan_blocks(row_keys, q_lens, q.device)
    empty = k_cache.new_empty((0, *k_cache.shape[1:]), dtype=torch.float32)
    known, fresh = [], []
    for b, blocks in enumerate(plan.row_blocks):
        have = known_block_keys[b] if known_block_keys is not None and known_block_keys[b] is not None else None
        have = have[:blocks] if have is not None else empty  # a host shape: no read back
        known.append(have)
        fresh.append(blocks - have.shape[0])
    row_slots = plan.block_slots.split(plan.row_blocks)
    built = compress_blocks(k_cache, torch.cat([s[s.shape[0] - n:] for s, n in zip(row_slots, fresh)]),
                            where_offered("block_compress", impl), extra_keys).split(fresh)
    # Kept in the pool's dtype (the index lives as long as its row: half the bytes of float32 on a
    # 16-bit pool), fresh keys rounded the same, so a block scores alike whether built now or before.
    index_dtype = k_cache.dtype if k_cache.dtype.itemsize >= 2 else torch.float32  # not an 8-bit cache's
    per_row = [torch.cat([have.to(index_dtype), new.to(index_dtype)]) for have, new in zip(known, built)]
    chosen = select_blocks(q, torch.cat(per_row).float(), plan.block_from, plan.block_to, budget_blocks,
                           sink_blocks, scaling, where_offered("block_select", impl),
                           max_span=max(plan.row_blocks, default=0), spans=plan.spans)  # a query sees its row's blocks at most
    out = block_sparse_attention(q, k_cache, v_cache, plan.block_slots, plan.block_positions, chosen, plan.q_positions,
                                 scaling, where_offered("block_sparse_attention", impl), extra_keys, extra_values, plans)
    return out, per_row
