"""Every benchmark in perf/ (but gpu_check.py: test_ops_prefix_attention.py runs its --smoke sizes) at smoke size, so none can rot.

Each test runs one script as its own subprocess with tiny arguments (its own servers, nothing shared
between tests), then checks that it exited cleanly and that its stdout ends with one JSON object
carrying the keys the README's figures are read from (perf/README.md names each full-size command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "perf" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = proc.stdout
    start = next((i for i, line in enumerate(out.splitlines(keepends=True)) if line.startswith("{")), None)
    assert start is not None, f"{script} printed no JSON object:\n{out[-2000:]}"
    text = "".join(out.splitlines(keepends=True)[start:])
    result, end = json.JSONDecoder().raw_decode(text)
    assert not text[end:].strip(), f"{script} printed more after its JSON: {text[end:][:500]!r}"
    return result


def has(mapping: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in mapping]
    assert not missing, f"missing keys {missing} in {sorted(mapping)}"


def test_bench_compaction_smoke():
    # Prefilled in chunks of 64 tokens, and again in one chunk on a second server for the keep-sets. The
    # small pool fills with earlier parents' chunks (idle radix entries): KVzip, which then needs fresh
    # slots to hold its context, must evict them (adapter.views.SGLangKVPool.alloc) or it is skipped.
    r = run_bench("bench_compaction.py", "--context", "256", "--pool", "1024", "--chunked-prefill-size", "64",
                  "--check-chunking", timeout=600)
    has(r, "model", "context_tokens", "keep_fraction", "prefill_s", "policies", "compacted_sessions_fit",
        "uncompacted_sessions_fit", "sessions_ratio", "store_slots")
    assert r["context_tokens"] == 256 and r["compacted_sessions_fit"] > r["uncompacted_sessions_fit"] > 0
    for policy in ("gatesight", "kvzip", "keydiff"):
        has(r["policies"][policy], "scoring_plus_compaction_frac_of_prefill", "freed_vs_theoretical", "slots", "child_s")
    # H2O's column sums are held per KV head: 256 tokens x 2 KV heads x 2 attention layers x 4 bytes.
    assert r["policies"]["h2o"]["recorded_signal_bytes"] == 256 * 2 * 2 * 4 < r["full_context_all_layers_f32_bytes_computed"]
    assert r["policies"]["gatesight"]["recorded_signal_bytes"] > 0
    assert r["chunked_prefill_size"] == 64
    for policy, row in r["policies"].items():
        assert row["keep_set_overlap_with_one_chunk"] >= 0.99, policy


def test_bench_gdn_smoke():
    r = run_bench("bench_gdn.py", "--tokens", "256", "--serve")
    has(r, "tokens", "gdn_layer_chunked_s", "gdn_layer_recurrent_s_estimated", "chunked_speedup_over_recurrent",
        "server_prefill_s", "server_prefill_tokens_per_s")
    assert r["tokens"] == 256


def test_bench_plain_overhead_smoke():
    r = run_bench("bench_plain_overhead.py", "--requests", "2")
    has(r, "requests_per_arm", "none_mean_s", "none_median_s", "knorm_mean_s", "knorm_median_s",
        "active_over_none_mean", "active_over_none_median", "active_arm_store_contexts")
    assert r["requests_per_arm"] == 2 and r["active_arm_store_contexts"] == 1


def test_bench_scoring_cost_smoke():
    r = run_bench("bench_scoring_cost.py", "--contexts", "256", "--kvzip-contexts", "256")
    has(r["gatesight"]["256"], "prefill_s", "capture_s", "signals_s", "score_select_s", "compact_s",
        "scoring_frac_of_prefill", "scoring_plus_compaction_frac_of_prefill", "kept_entries")
    has(r["kvzip"]["256"], "hf_prefill_s", "second_pass_s", "second_pass_frac_of_prefill")


def test_bench_oda_smoke():
    r = run_bench("bench_oda.py", "--lengths", "256", "--new-tokens", "4", "--repeats", "1", "--prompts", "niah_single_1")
    has(r, "model", "head", "lengths", "crossover_length", "head_cost_fraction_of_local_step")
    assert r["prompts"] == "niah_single_1"
    row = r["lengths"]["256"]
    has(row, "full", "local_first_0", "local_first_12.5", "local_first_50", "local_first_100", "oda")
    has(row["oda"], "per_step_s", "speedup_over_full", "flops_ratio_to_full", "full_rate")


def test_bench_oda_quality_smoke():
    r = run_bench("bench_oda_quality.py", "--samples", "1", "--length", "512", "--tasks", "niah_single_1", "--seed", "3")
    has(r, "model", "length", "tasks", "arms", "full_minus_local")
    assert r["seed"] == 3
    has(r["arms"], "full", "local", "oda@0", "random@0")
    has(r["arms"]["oda@0"], "score", "full_rate", "gap_recovered")


def test_bench_sessions_smoke():
    # 3 documents of ~450 tokens in a 1,024-slot pool: uncompacted they cannot all stay resident.
    r = run_bench("bench_sessions.py", "--sessions", "3", "--questions", "2", "--length", "512", "--pool", "1024",
                  "--clients", "2")
    has(r, "pool_tokens", "sessions", "questions_per_session", "seed", "arms")
    keys = ("peak_resident_sessions", "peak_pool_tokens_in_use", "questions", "questions_per_s", "context_reprefills",
            "reprefill_rate", "latency_p50_s", "latency_p99_s", "answers_right", "parents_sent")
    has(r["arms"]["off"], *keys)
    has(r["arms"]["on"], *keys, "peak_store_contexts", "parents_resent", "contexts_evicted", "slots_per_context_mean")
    for arm in r["arms"].values():
        assert arm["questions"] == 6 and arm["parents_sent"] >= 3
    assert r["arms"]["on"]["peak_store_contexts"] == 3 and r["arms"]["on"]["context_reprefills"] == 0


def test_bench_gate_eviction_smoke(tmp_path):
    result = run_bench("bench_gate_eviction.py", "--val-sequences", "2", "--test-sequences", "2", "--probe-sequences", "1",
                       "--out", str(tmp_path))
    has(result, "dense_test_ppl", "validation_sweeps", "tau_star", "test_matched", "ordering", "random_probe",
        "row_sum_cv", "gates")
    assert len(result["test_matched"]) == 4 and (tmp_path / "table.csv").exists() and (tmp_path / "tau_sweep.png").exists()


def test_bench_gate_decode_smoke():
    result = run_bench("bench_gate_decode.py", "--new-tokens", "80", "--repeats", "1", "--tau", "0.1")
    has(result, "decode_seconds_per_step", "gate_vs_plain", "gate_report", "memory")
    assert result["gate_report"]["folds"] == 1 and result["memory"]["pool_bytes_peak"]["gate"] > 0


def test_bench_head_decode_smoke():
    result = run_bench("bench_head_decode.py", "--prompt", "100", "--new-tokens", "20", "--repeats", "1", "--budget", "32")
    has(result, "decode_seconds_per_step", "h2o_vs_plain", "keydiff_vs_plain", "reports", "pool_bytes_peak")
    assert result["reports"]["h2o"]["evicted_entries"] > 0 and result["reports"]["keydiff"]["budget"] == 32


def test_bench_sparse_attention_smoke():
    result = run_bench("bench_sparse_attention.py", "--length", "512", "--samples", "1", "--tasks", "niah_single_1",
                       "--budget", "64", "--index-fractions", "0.5", "--index-lengths", "512,1024",
                       "--scan-lengths", "1024,2048", "--scan-rows", "1,4", "--scan-shapes", "model", "--repeats", "2", "--max-new-tokens", "8")
    has(result, "accuracy", "index_sizes", "scan_per_decode_step", "regrouped_minus_sparse_full")
    for n in ("512", "1024"):
        index = result["index_sizes"][n]["0.5"]
        assert int(n) >= index["context_tokens"] > int(n) // 2  # the prompt holds the question too
        assert index["full_context_blocks"] == -(-index["context_tokens"] // 4) > max(index["regrouped_blocks_per_layer"]) > 0
    scans = result["scan_per_decode_step"][result["model_shape"]]["rows4"]
    assert set(scans) == {"1024", "2048", "fit_over_blocks_scanned"} and scans["2048"]["p0.5"]["index_vs_full"] == 0.5


def test_bench_allocation_smoke():
    r = run_bench("bench_allocation.py", "--tasks", "niah_single_1", "--samples", "1", "--arms", "gate,floor0.5,flat",
                  "--fractions", "0.05")
    rows = {(row["arm"], row["keep_fraction"]): row for row in r["rows"]}
    assert set(rows) == {("full", 1.0), ("gate", 0.05), ("floor0.5", 0.05), ("flat", 0.05)}
    gate, floor, flat = (rows[(arm, 0.05)]["mean_budget_per_layer"] for arm in ("gate", "floor0.5", "flat"))
    # Same total; the floor sits halfway between the gate's split and the flat one.
    assert abs(sum(gate) - sum(flat)) <= 1 and abs(sum(floor) - sum(flat)) <= 1 and flat[0] == flat[1]
    assert all(min(g, f) - 1 <= h <= max(g, f) + 1 for g, h, f in zip(gate, floor, flat))
    assert len(rows[("flat", 0.05)]["needle_value_entries_kept_per_layer"]) == 2


def test_bench_cpu_extend_smoke():
    result = run_bench("bench_cpu_extend.py", "--cases", "300+1,100+200")
    has(result, "shape", "cases")
    for row in result["cases"].values():
        has(row, "sglang_torch_native_s", "kvx_torch_native_s", "speedup", "max_abs_diff")
        assert row["max_abs_diff"] < 1e-5


def test_oda_local_guard_smoke():
    r = run_bench("oda_local_guard.py", "--model", "weights/tiny-hybrid-deep", "--tasks", "niah_single_1",
                  "--samples", "1", "--length", "512", "--new-tokens", "8", "--arms", "full,local,head,guard:1.01",
                  "--lost-steps")
    has(r, "arms", "lost_steps", "seed")
    assert r["arms"]["full"]["full_rate"] == 1.0 and r["arms"]["local"]["full_rate"] == 0.0
    # a guard above any probability sends every step Full: plain decoding
    assert r["arms"]["guard:1.01"] == r["arms"]["full"]
    for arm in r["arms"].values():
        has(arm, "score", "full_rate", "gap_share")
