"""Issue #56 item 2 on CUDA's Triton backend: SGLang's own Triton kernels read a layer's page table
(``sglang_kvx/adapter/triton_tables.py``), run here under the Triton interpreter on CPU.

Each case builds a batch's tables with ``build_batch_reads`` over one allocation of three layers' K/V
(``test_page_tables.arena``), runs SGLang's ``decode_attention_fwd`` / ``extend_attention_fwd`` through
``table_decode`` / ``table_extend``, and compares every (row, query head) with softmax attention over
the keys and values gathered by hand from the cells the row reads: a per-head context (own ranks per KV
head, a borrowed cell of another layer and head), a folded per-row context (cells of another layer), a
decode-step span in the layer's own buffer, and a plain row beside them. Building the kernels' inputs
reads nothing back from the device (counted)."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest
import requests
import torch

from interpreter import interpreted_lines
from server_pool import spec
from test_compaction_e2e import text


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, before: int | None) -> torch.Tensor:
    """Softmax attention of ``query`` [heads, tokens, D] over ``keys`` / ``values`` [n, D], scale 0.5;
    ``before``: an extend's cells before its new tokens (its new tokens causal), None for one decode query."""
    scores = query @ keys.T * 0.5
    if before is not None:
        visible = torch.ones(query.shape[1], keys.shape[0], dtype=torch.bool).tril(before)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def run_cases() -> None:
    """Under TRITON_INTERPRET=1 (a fresh process): print one line per case, its largest error and host syncs."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from test_page_tables import HEADS, DIM, arena

    from sglang_kvx.adapter.triton_tables import table_decode, table_extend, table_prefix
    from sglang_kvx.ops.host_syncs import HostSyncCounter
    from sglang_kvx.serve.page_tables import build_batch_reads, ragged_lists
    from sglang_kvx.store import PrefixCells

    torch.manual_seed(0)
    whole, space = arena()
    layer = whole[1]  # layer 11: [2 (K, V), slots, heads, D]
    req_to_token = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16)
    group = 2  # query heads per KV head

    def decode_case(name, cells, layer_ids, index, by_hand):
        reads = build_batch_reads([{0: cells}] if len(layer_ids) == 1 else [{}, {0: cells}], layer_ids, [1, 2],
                                  [8, 6], None, req_to_token, space)
        table = reads.tables[index]
        queries = torch.randn(2, group * HEADS, DIM)
        k_cache = space.keys if table.space is not None else layer[0]
        v_cache = space.values if table.space is not None else layer[1]
        with HostSyncCounter() as counter:
            ragged = ragged_lists(table.cells, table.lens, table.lens_host)
        out = table_decode(decode_attention_fwd, queries, k_cache, v_cache, table, ragged, 0.5, 4)
        error = max((out[row, group * head:group * (head + 1)]
                     - _attend(queries[row, group * head:group * (head + 1), None], keys, values, None)[:, 0])
                    .abs().max().item() for (row, head), (keys, values) in by_hand.items())
        print(name, error, counter.total)

    def extend_case(name, cells, layer_ids, index, q_lens, by_hand):
        reads = build_batch_reads([{0: cells}] if len(layer_ids) == 1 else [{}, {0: cells}], layer_ids, [1, 2],
                                  [8, 6], q_lens, req_to_token, space)
        table = reads.tables[index]
        queries = torch.randn(sum(q_lens), group * HEADS, DIM)
        new_slots = torch.tensor([16 + 8 - q_lens[0] + i for i in range(q_lens[0])]
                                 + [32 + 6 - q_lens[1] + i for i in range(q_lens[1])])
        k_cache = space.keys if table.space is not None else layer[0]
        v_cache = space.values if table.space is not None else layer[1]
        with HostSyncCounter() as counter:
            prefix = table_prefix(table, q_lens)
        out = table_extend(extend_attention_fwd, queries, layer[0, new_slots], layer[1, new_slots], k_cache, v_cache,
                           table, prefix, q_lens, 0.5)
        error = 0.0
        for (row, head), (tokens, keys, values, before) in by_hand.items():
            query = queries[tokens, group * head:group * (head + 1)].transpose(0, 1)
            expected = _attend(query, keys, values, before).transpose(0, 1)
            error = max(error, (out[tokens, group * head:group * (head + 1)] - expected).abs().max().item())
        print(name, error, counter.total)

    def row(start, stop, head):  # layer 11's keys and values of slots [start, stop) in one KV head
        return layer[0, start:stop, head], layer[1, start:stop, head]

    def cat(*parts):
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def other(layer_index, slots, head):  # another layer's cells
        return whole[layer_index, 0, slots, head], whole[layer_index, 1, slots, head]

    # A per-head context of 5 slots (pool row 1): head 0 keeps 3 own ranks and borrows layer 12's head-1 cells
    # 50, 51; head 1 keeps 1; then the row's tokens. Pool row 2 reads its whole row.
    per_head = PrefixCells(num_slots=5, own=1, head_own=(3, 1), head_borrowed=(((12, 1, torch.tensor([50, 51])),), ()))
    decode_case("per_head_decode", per_head, [11], 0, {
        (0, 0): cat(row(16, 19, 0), other(2, slice(50, 52), 1), row(21, 24, 0)), (0, 1): cat(row(16, 17, 1), row(21, 24, 1)),
        (1, 0): row(32, 38, 0), (1, 1): row(32, 38, 1)})
    per_head_extend = PrefixCells(num_slots=5, own=1, head_own=(3, 1), head_borrowed=((), ((12, 0, torch.tensor([60])),)))
    extend_case("per_head_extend", per_head_extend, [11], 0, [3, 2], {
        (0, 0): (slice(0, 3), *cat(row(16, 19, 0), row(21, 24, 0)), 3),
        (0, 1): (slice(0, 3), *cat(row(16, 17, 1), other(2, slice(60, 61), 0), row(21, 24, 1)), 2),
        (1, 0): (slice(3, 5), *row(32, 38, 0), 4), (1, 1): (slice(3, 5), *row(32, 38, 1), 4)})
    # A folded context of 6 slots: 4 own ranks, then layer 12's cells 40, 41 (every head), then its tokens
    folded = PrefixCells(num_slots=6, own=4, borrowed=((12, torch.tensor([40, 41])),))
    decode_case("folded_decode", folded, [10, 11], 1, {
        (r, h): cat(row(16, 20, h), other(2, slice(40, 42), h), row(22, 24, h)) if r == 0 else row(32, 38, h)
        for r in (0, 1) for h in range(HEADS)})
    extend_case("folded_extend", folded, [10, 11], 1, [2, 3], {
        (r, h): (slice(0, 2), *cat(row(16, 20, h), other(2, slice(40, 42), h), row(22, 24, h)), 6) if r == 0
        else (slice(2, 5), *row(32, 38, h), 3) for r in (0, 1) for h in range(HEADS)})
    # A decode-step span in the layer's own buffer: 2 sinks, then the last 3 of 8 positions
    span = PrefixCells(num_slots=5, own=2, borrowed=())
    decode_case("span_decode", span, [11], 0, {
        (r, h): cat(row(16, 18, h), row(21, 24, h)) if r == 0 else row(32, 38, h) for r in (0, 1) for h in range(HEADS)})


def test_sglangs_triton_kernels_read_per_head_folded_and_span_tables_exactly_and_syncless() -> None:
    lines = interpreted_lines("import sys; sys.path.insert(0, 'tests'); "
                              "from test_triton_tables import run_cases; run_cases()")
    results = {name: (float(error), int(syncs)) for name, error, syncs in (line.split() for line in lines[-7:])
               if name.endswith(("_decode", "_extend"))}
    assert set(results) == {"per_head_decode", "per_head_extend", "folded_decode", "folded_extend", "span_decode"}, lines
    assert all(error < 1e-5 for error, _ in results.values()), results
    assert all(syncs == 0 for _, syncs in results.values()), results


def test_a_built_triton_backend_becomes_its_page_table_reader_where_the_contract_names_it() -> None:
    import importlib

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_kvx.adapter.attention import ReadsPageTables, with_per_layer_lengths
    from sglang_kvx.adapter.contract import PAGE_TABLE_READERS

    name = f"{TritonAttnBackend.__module__}.{TritonAttnBackend.__qualname__}"
    reader_module = importlib.import_module(PAGE_TABLE_READERS[name])
    backend = with_per_layer_lengths(TritonAttnBackend.__new__(TritonAttnBackend))  # as SGLang built it, switched
    assert type(backend) is reader_module.KvxTritonAttnBackend
    assert isinstance(backend, TritonAttnBackend) and isinstance(backend, ReadsPageTables)


# Rows reading other than their whole rows, by kind: (the parent's kvx fields, or None: no parent; each row's).
TABLE_KINDS = {
    "pyramidkv": ({"policy": "keydiff", "keep_fraction": 0.5, "allocation": "pyramidkv"}, None),
    "global": ({"policy": "keydiff", "keep_fraction": 0.3, "allocation": "global"}, None),
    "streamingllm": (None, {"decode": {"step": "streamingllm", "sinks": 4, "window": 24}}),
}


@pytest.mark.slow
@pytest.mark.long  # SGLang's kernels under the Triton interpreter: minutes of CPU
def test_a_triton_backend_server_reads_children_and_spans_through_page_tables_as_the_cpu_default(
        shared_specs, server_pool, references):
    """The real server with ``--attention-backend triton`` (SGLang's Triton backend, its kernels under the Triton
    interpreter on CPU) answers four rows at once of per-layer (PyramidKV) and per-head (``global``) children and
    StreamingLLM rows token for token as the shared compacting server (``kvx_torch_native``), with no layer
    call through ``masked_attention``."""
    from test_gpu_defaults import body, send

    base = shared_specs("compacting", "tiny-llama")
    triton = server_pool.get(spec(base.model_path, *base.args, "--attention-backend", "triton",
                                  max_total_tokens=base.max_total_tokens, env={**dict(base.env), "TRITON_INTERPRET": "1"}))
    eager = server_pool.get(base, hot=True)
    assert requests.get(triton.url + "/server_info", timeout=30).json()["attention_backend"] == "triton"
    ref = references["tiny-llama"]
    context = ref.encode(text(160, seed=851))
    masked_before = triton.stats()["masked_attention_calls"]
    for kind, (parent, fields) in TABLE_KINDS.items():
        prompts = [(context if parent else ref.encode(text(80, seed=860 + row))) + ref.encode(text(6, seed=870 + row))
                   for row in range(4)]
        answers = []
        for server in (triton, eager):
            server.flush()
            if parent is not None:
                assert send(server, body(context, 0, **parent))[0] == 200
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda ids: send(server, body(ids, 8, **(parent or fields))), prompts))
            assert all(status == 200 for status, _ in replies), (kind, replies)
            if parent is not None:
                assert all(reply["meta_info"]["kvx"][-1].get("child") for _, reply in replies), kind
            answers.append([reply["output_ids"] for _, reply in replies])
        assert answers[0] == answers[1], kind
    assert triton.stats()["masked_attention_calls"] == masked_before


if __name__ == "__main__":
    sys.exit(run_cases())
