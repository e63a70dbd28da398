"""Issue #56 item 7: what a long parent's signals and the block-sparse indexer hold at once does not grow
with the context. H2O's column sums were a [q_heads, 512, S] float32 block per query block (8.6 GB per
layer at 128K on 32 heads), the indexer's scores a [chunk, Hkv, S / 4] float32 matrix (8.6 GB for a
chunk of 8K queries over 128K keys at 8 KV heads). Both are now tiled.

Measured, not modelled: one fresh process runs each op at 32K and at 128K keys (small heads, so that
it takes seconds on a CPU) and reads its peak resident memory above where it stood before the call
(Linux's VmHWM, reset through /proc/self/clear_refs before each). The bound: the 128K peak within
the 32K one plus a margin, and under a fixed ceiling, where the untiled ops needed 405 MiB and
1,617 MiB (column sums) and 176 MiB and 704 MiB (scores) here; the tiled ones 48 and 64 MiB at both."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent('''
    import json, math, torch
    torch.manual_seed(0)

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def peak_of(call):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current VmRSS
        before = status("VmRSS")
        call()
        return status("VmHWM") - before

    from sglang_kvx.signals.column_sums import add_column_sums
    from sglang_kvx.ops.block_sparse import select_blocks

    out = {}
    for n in (4096, 32768, 131072):  # the first a warm-up: the libraries' one-time buffers, not the ops
        q_heads, kv_heads, dim, t = 2, 1, 16, 512
        keys = torch.randn(n, kv_heads, dim)
        queries = torch.randn(t, q_heads, dim)
        sums = torch.zeros(kv_heads, n)
        out[f"column_sums_{n}"] = peak_of(lambda: add_column_sums(sums, queries, keys, dim ** -0.5, n - t))
        blocks, chunk = n // 4, 2048  # the last 2,048 queries of an n-token prefill, over its n / 4 blocks
        block_keys = torch.randn(blocks, kv_heads, dim)
        q = torch.randn(chunk, q_heads, dim)
        block_from = torch.zeros(chunk, dtype=torch.long)
        block_to = (torch.arange(n - chunk, n) // 4 + 1).long()
        out[f"scores_{n}"] = peak_of(lambda: select_blocks(q, block_keys, block_from, block_to, 8, 1, dim ** -0.5, "torch"))
    print(json.dumps({key: value for key, value in out.items() if not key.endswith("_4096")}))
''')


# glibc otherwise keeps freed blocks (and raises its mmap threshold after a large free), so a call's peak
# could hide in memory an earlier call freed: every block of 64 KiB and more is mapped and unmapped alone,
# and the resident memory follows the live tensors.
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's per-process peak memory")
def test_transients_of_column_sums_and_block_scores_do_not_grow_with_the_context():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **EXACT_MALLOC})
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    mib = {key: round(value / 2**20, 1) for key, value in peaks.items()}
    for op in ("column_sums", "scores"):
        short, long = peaks[f"{op}_32768"], peaks[f"{op}_131072"]
        assert long <= short + (48 << 20), mib  # 4x the keys: no 4x the memory
        assert long <= 160 << 20, mib
    print(f"[kvx memory] peak MiB above the start of each call: {mib}")


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_tiled_column_sums_are_the_causal_softmax_matrixs_column_sums(monkeypatch, per_kv_head):
    """Tiles of 64 keys and blocks of 32 queries (several of each, a chunk starting mid-row) add what the
    whole causal softmax matrix of the chunk's queries sums to per key, written out directly here."""
    import sglang_kvx.signals.column_sums as column_sums

    monkeypatch.setattr(column_sums, "KEY_TILE", 64)
    monkeypatch.setattr(column_sums, "QUERY_BLOCK", 32)
    torch.manual_seed(3)
    n, first, q_heads, kv_heads, dim = 300, 170, 4, 2, 8
    keys, queries = torch.randn(n, kv_heads, dim), torch.randn(n - first, q_heads, dim)
    sums = torch.zeros(kv_heads if per_kv_head else q_heads, n)
    column_sums.add_column_sums(sums, queries, keys, dim ** -0.5, first)
    per_head_keys = keys.repeat_interleave(q_heads // kv_heads, dim=1)  # query head h reads KV head h // 2
    logits = torch.einsum("thd,shd->hts", queries, per_head_keys) * dim ** -0.5
    future = torch.arange(n)[None, :] > torch.arange(first, n)[:, None]
    expected = logits.masked_fill(future, float("-inf")).softmax(dim=-1).sum(dim=1)  # [q_heads, n]
    if per_kv_head:
        expected = expected.view(kv_heads, q_heads // kv_heads, n).sum(dim=1)
    torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-5)


def test_tiles_of_queries_pick_the_blocks_one_tile_picks(monkeypatch):
    """The indexer scored a few queries at a time (tiles of at most 3 rows' worth of scores) picks the
    blocks it picks scoring every query at once."""
    import sglang_kvx.ops.block_sparse as block_sparse

    torch.manual_seed(4)
    blocks, queries, q_heads, kv_heads, dim = 40, 37, 4, 2, 8
    block_keys, q = torch.randn(blocks, kv_heads, dim), torch.randn(queries, q_heads, dim)
    block_from = torch.tensor([0] * 20 + [25] * 17)
    block_to = torch.cat([torch.arange(6, 26), torch.arange(26, 43).clamp(max=40)])
    whole = block_sparse.select_blocks(q, block_keys, block_from, block_to, 5, 1, dim ** -0.5, "torch")
    monkeypatch.setattr(block_sparse, "SCORE_TILE_BYTES", 3 * kv_heads * 25 * 4 * 3)
    assert len(block_sparse._score_tiles(queries, 25, kv_heads)) == 13  # 37 queries, 3 a tile
    tiled = block_sparse.select_blocks(q, block_keys, block_from, block_to, 5, 1, dim ** -0.5, "torch")
    assert torch.equal(tiled, whole)
