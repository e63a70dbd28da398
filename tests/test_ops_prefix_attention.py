"""Paged attention with hidden prefix ranks and borrowed cells (ops/prefix_attention.py).

The torch reference is checked against an independent computation (the visible keys gathered
by hand, then SGLang-free scaled-dot-product attention); the Triton kernel against the
reference under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang_kvx.ops.prefix_attention import prefix_cells_attention, prefix_cells_attention_reference

from interpreter import interpreted_lines


ROOT = Path(__file__).resolve().parents[1]


def random_case(seed: int, dtype: torch.dtype = torch.float32, decode: bool = False, per_head: bool = False) -> dict:
    """Three rows over a shared pool: one hides a range and borrows entries, one is plain, one
    hides its whole prefix past rank 3 and borrows; GQA with 2 KV heads for 4 query heads.
    ``per_head``: the two KV heads hide different ranges and read different numbers of the extra
    entries (a context compacted with per-head budgets)."""
    g = torch.Generator().manual_seed(seed)
    pool, kv_heads, heads, dim, v_dim = 600, 2, 4, 24, 16
    k_cache = torch.randn(pool, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, kv_heads, v_dim, generator=g).to(dtype)
    req_to_token = torch.randperm(pool, generator=g)[: 6 * 90].reshape(6, 90).to(torch.int32)
    seq_lens = torch.tensor([60, 85, 40])
    q_lens = torch.ones(3, dtype=torch.long) if decode else torch.tensor([3, 7, 1])
    extra_indptr = torch.tensor([0, 5, 5, 12])
    return dict(
        q=torch.randn(int(q_lens.sum()), heads, dim, generator=g).to(dtype), k_cache=k_cache, v_cache=v_cache,
        req_to_token=req_to_token, rows=torch.tensor([4, 0, 2]), seq_lens=seq_lens, q_lens=q_lens,
        hidden_from=torch.tensor([12, 0, 3]), hidden_to=torch.tensor([30, 0, 20]),
        extra_k=torch.randn(12, kv_heads, dim, generator=g).to(dtype),
        extra_v=torch.randn(12, kv_heads, v_dim, generator=g).to(dtype), extra_indptr=extra_indptr,
        scaling=0.2, k_scale=1.5, v_scale=0.5,
    ) | ({} if not per_head else dict(
        hidden_from=torch.tensor([[12, 20], [0, 0], [3, 9]]), hidden_to=torch.tensor([[30, 30], [0, 0], [20, 20]]),
        extra_counts=torch.tensor([[5, 2], [0, 0], [7, 0]]),
    ))


def by_hand(case: dict) -> torch.Tensor:
    """Per query: gather exactly the keys it may see, then plain SDPA per head."""
    outs = []
    start = 0
    for b in range(case["rows"].numel()):
        row, seq_len, q_len = int(case["rows"][b]), int(case["seq_lens"][b]), int(case["q_lens"][b])
        e0 = int(case["extra_indptr"][b])
        kv_heads = case["k_cache"].shape[1]
        group = case["q"].shape[1] // kv_heads
        for t in range(q_len):
            last = seq_len - q_len + t
            per_query_head = []
            for head in range(case["q"].shape[1]):
                kv = head // group
                bound = lambda name: int(case[name][b] if case[name].dim() == 1 else case[name][b, kv])
                lo, hi = bound("hidden_from"), bound("hidden_to")
                count = int(case["extra_counts"][b, kv]) if "extra_counts" in case else int(case["extra_indptr"][b + 1]) - e0
                seen = [j for j in range(last + 1) if not lo <= j < hi]
                slots = case["req_to_token"][row, seen].long()
                keys = torch.cat([case["k_cache"][slots, kv], case["extra_k"][e0 : e0 + count, kv]]).float() * case["k_scale"]
                values = torch.cat([case["v_cache"][slots, kv], case["extra_v"][e0 : e0 + count, kv]]).float() * case["v_scale"]
                query = case["q"][start + t, head].float()  # [D]
                out = F.scaled_dot_product_attention(query[None, None], keys[None], values[None], scale=case["scaling"])
                per_query_head.append(out[0, 0])
            outs.append(torch.stack(per_query_head))
        start += q_len
    return torch.stack(outs)


@pytest.mark.parametrize("decode,per_head", [(False, False), (True, False), (False, True), (True, True)])
def test_reference_sees_exactly_the_visible_keys(decode, per_head) -> None:
    case = random_case(0, decode=decode, per_head=per_head)
    got = prefix_cells_attention_reference(**case)
    assert torch.allclose(got, by_hand(case), atol=1e-5)
    # Hiding nothing and borrowing nothing is plain causal attention over the row: the check can fail.
    plain = {**case, "hidden_to": case["hidden_from"], "extra_indptr": torch.zeros(4, dtype=torch.long)}
    plain.pop("extra_counts", None)
    assert not torch.allclose(prefix_cells_attention_reference(**plain), got, atol=1e-3)
    assert torch.allclose(prefix_cells_attention_reference(**plain), by_hand(plain), atol=1e-5)


def test_triton_kernel_matches_the_reference_under_the_interpreter() -> None:
    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_ops_prefix_attention import random_case\n"
        "from sglang_kvx.ops.prefix_attention import prefix_cells_attention\n"
        "worst = 0.0\n"
        "for seed, dtype, decode, per_head in [(1, torch.float32, False, False), (2, torch.float32, True, False),\n"
        "                                      (3, torch.bfloat16, True, False), (4, torch.float32, False, True)]:\n"
        "    case = random_case(seed, dtype, decode, per_head)\n"
        "    got = prefix_cells_attention(**case, impl='triton').float()\n"
        "    want = prefix_cells_attention(**case, impl='torch').float()\n"
        "    worst = max(worst, float((got - want).abs().max()))\n"
        "print(worst)\n"
    )
    lines = interpreted_lines(code)
    assert float(lines[-1]) < 1e-2  # bf16 outputs round at ~4e-3


def test_bad_shapes_and_cpu_triton_are_refused(monkeypatch) -> None:
    case = random_case(0)
    with pytest.raises(ValueError, match="q_lens"):
        prefix_cells_attention(**{**case, "q_lens": case["q_lens"] + 1})
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        prefix_cells_attention(**{**case, "q": case["q"][:, :3]})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        prefix_cells_attention(**case, impl="triton")


def test_the_gpu_check_script_runs_its_smoke_sizes_under_the_interpreter() -> None:
    """perf/gpu_check.py is what a session with a lent GPU runs first; keep it runnable."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "perf/gpu_check.py", "--smoke"], env=env, capture_output=True,
                            text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    *checks, report = [json.loads(line) for line in result.stdout.splitlines()]  # one line per check, then the verdict
    assert report["passed"] and report["checks"] == len(checks)
    (cost,) = report["gatesight_cost"]  # scoring against a prefill lower bound, here at a tiny shape
    assert cost["scoring_s"] > 0 and cost["prefill_lower_bound_s_computed"] > 0
    # MLP, prefix, gated x 2, block-sparse x 3, window attention, state snapshot (bit-exact), the
    # capture -> compaction path of every served policy on the device (here the CPU against itself), and
    # the server's start-up check of every op (here each op's Triton kernel in the interpreter)
    from sglang_kvx.ops.dispatch import OPS
    from sglang_kvx.policies import servable_policy_names

    assert len(checks) == 9 + len(servable_policy_names()) + len(OPS), [c["case"] for c in checks]
    assert {c["case"].split()[1] for c in checks if c["case"].startswith("warm_up ")} == set(OPS)
    assert all(c["max_abs_err"] <= c["tolerance"] and c["max_abs_err"] < 1e-4 for c in checks), checks
    # A planted wrong kernel fails the script, and only that check is named.
    planted = subprocess.run([sys.executable, "perf/gpu_check.py", "--smoke", "--plant"], env=env, capture_output=True,
                             text=True, cwd=ROOT, timeout=600)
    assert planted.returncode == 1, planted.stderr[-2000:]
    assert json.loads(planted.stdout.splitlines()[-1])["failed"] == ["gatesight_mlp n=70 (planted wrong kernel)"]
