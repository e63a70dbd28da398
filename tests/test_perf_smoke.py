"""Every benchmark in perf/ compiles and imports what it names (the suite), and runs at smoke size (CI's long tier).

The suite's check (``test_every_benchmark_imports``, in-process, seconds): each script loads as a
module -- its imports of this package, SGLang and its sibling scripts resolve and its top level runs
-- so a renamed function or moved module breaks the suite, not the next benchmark run. Running every
script at smoke size takes ~9 minutes of server work (over a third of the suite's budget); it runs in
the long tier, which CI runs after the suite on every change, so no script lands broken either way.

The long-tier run: every benchmark in perf/ (but gpu_check.py: test_ops_prefix_attention.py runs its --smoke sizes;
kvpress_compare.py with its worker, which need a 661 MB venv of kvpress from PyPI; and bench_router.py,
which starts workers and routers of its own: its router process and the shared context directory are
exercised in test_context_dir_e2e.py) at smoke size, so none can rot.

One test runs them all, each script as its own subprocess (its imports, threads and exit status its
own), with its smallest inputs, against the suite's shared servers wherever one fits the script's
configuration (``--url``; perf/served.py reads what the script reports about a server it did not
start from that server). Only ``bench_gate_decode.py`` still starts its own: its plain arm needs a
gate cell served with no default decode step, a configuration no other test shares. After each
script every shared server it used is flushed and checked whole (the pool's own check), so a leak is
pinned on the script that made it. Each run must exit cleanly and end its stdout with one JSON
object carrying the keys the README's figures are read from (perf/README.md names each full-size
command); where a figure comes from the server it ran on, the test checks it is that server's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server_pool import CHUNK, SPARSE_BUDGET

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


# Not imported here: kvpress_worker.py runs in kvpress's own venv (kvpress is not installed in this one);
# sweep_oda_head.py is a sweep with no main guard (loading it runs it; the long-tier run leaves it out too).
NOT_IMPORTABLE_HERE = {"kvpress_worker.py", "sweep_oda_head.py"}
LIBRARIES = {"served.py"}  # imported by the scripts, no command of its own


def test_every_benchmark_imports():
    import runpy

    scripts = sorted(p for p in (ROOT / "perf").glob("*.py") if p.name not in NOT_IMPORTABLE_HERE)
    assert len(scripts) >= 24
    sys.path.insert(0, str(ROOT / "perf"))  # as when a script runs: its siblings import by name
    try:
        for script in scripts:
            namespace = runpy.run_path(str(script), run_name=f"perf_import_check_{script.stem}")
            assert script.name in LIBRARIES or callable(namespace.get("main")), f"{script.name} has no main()"
    finally:
        sys.path.remove(str(ROOT / "perf"))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.fresh_process
def test_every_benchmark_runs_at_smoke_size(shared_server, server_pool, tmp_path):
    seconds: dict[str, float] = {}
    hybrid = "tiny-hybrid-deep"

    def run(script: str, *args: str, timeout: float = 300) -> dict:
        t0 = time.monotonic()
        try:
            result = run_bench(script, *args, timeout=timeout)
        finally:
            seconds[script] = round(time.monotonic() - t0, 1)
        problems = server_pool.reset_used()  # the shared servers it used, flushed and checked whole
        assert not problems, f"{script} left a shared server behind:\n" + "\n".join(problems)
        return result

    try:
        # --- on the shared servers, each asked for right before the script using it -----------------
        plain = shared_server("plain", hybrid)
        r = run("bench_gdn.py", "--tokens", "256", "--serve", "--url", plain.url)
        has(r, "tokens", "gdn_layer_chunked_s", "gdn_layer_recurrent_s_estimated", "chunked_speedup_over_recurrent",
            "server_prefill_s", "server_prefill_tokens_per_s")
        # the server it timed, whose start it did not see
        assert r["tokens"] == 256 and r["server_model"] == hybrid and "server_startup_s" not in r

        plain, compacting = shared_server("plain", hybrid), shared_server("compacting", hybrid)
        r = run("bench_plain_overhead.py", "--requests", "2", "--url", f"none={plain.url}",
                "--url", f"knorm={compacting.url}")
        has(r, "requests_per_arm", "none_mean_s", "none_median_s", "knorm_mean_s", "knorm_median_s",
            "active_over_none_mean", "active_over_none_median", "active_arm_store_contexts")
        assert r["requests_per_arm"] == 2 and r["active_arm_store_contexts"] == 1
        # the policies the arms were served with, read from the servers (the active arm's is KeyDiff here)
        assert r["arm_servers"]["none"]["policy"] == "none" and r["arm_servers"]["knorm"]["policy"] == "keydiff"

        plain, compacting = shared_server("plain", hybrid), shared_server("compacting", hybrid)
        # 3 documents of ~450 tokens; the 'on' arm's parents are compacted by the server's own policy.
        r = run("bench_sessions.py", "--sessions", "3", "--questions", "2", "--length", "512", "--clients", "2",
                "--url", f"off={plain.url}", "--url", f"on={compacting.url}")
        has(r, "pool_tokens", "sessions", "questions_per_session", "seed", "arms")
        keys = ("peak_resident_sessions", "peak_pool_tokens_in_use", "questions", "questions_per_s", "context_reprefills",
                "reprefill_rate", "latency_p50_s", "latency_p99_s", "answers_right", "parents_sent")
        has(r["arms"]["off"], *keys)
        has(r["arms"]["on"], *keys, "peak_store_contexts", "parents_resent", "contexts_evicted", "slots_per_context_mean")
        for arm in r["arms"].values():
            assert arm["questions"] == 6 and arm["parents_sent"] >= 3
        assert r["arms"]["on"]["peak_store_contexts"] == 3 and r["arms"]["on"]["context_reprefills"] == 0
        # the pool and policy reported are the servers', not the script's defaults (32,768; GateSight at 0.1)
        assert r["pool_tokens"] == compacting.stats()["kv_pool_total_tokens"] == plain.stats()["kv_pool_total_tokens"]
        assert (r["policy"], r["keep_fraction"]) == ("keydiff", 0.5)

        compacting = shared_server("compacting", hybrid)  # decode steps on, a seeded random recall head
        r = run("bench_oda.py", "--model", hybrid, "--lengths", "256", "--new-tokens", "4", "--repeats", "1",
                "--prompts", "niah_single_1", "--url", compacting.url)
        has(r, "model", "head", "lengths", "crossover_length", "head_cost_fraction_of_local_step")
        assert r["prompts"] == "niah_single_1" and r["head"].startswith("the server's head")
        row = r["lengths"]["256"]
        has(row, "full", "local_first_0", "local_first_12.5", "local_first_50", "local_first_100", "oda")
        has(row["oda"], "per_step_s", "speedup_over_full", "flops_ratio_to_full", "full_rate")

        compacting = shared_server("compacting", hybrid)
        r = run("bench_oda_quality.py", "--samples", "1", "--length", "512", "--tasks", "niah_single_1", "--seed", "3",
                "--url", compacting.url)
        has(r, "model", "length", "tasks", "arms", "full_minus_local")
        assert r["seed"] == 3
        has(r["arms"], "full", "local", "oda@0", "random@0")
        has(r["arms"]["oda@0"], "score", "full_rate", "gap_recovered")

        compacting = shared_server("compacting", "tiny-llama")  # decode steps on; KVzap's surrogates for tiny-llama
        r = run("bench_kvzap_decode.py", "--model", "tiny-llama", "--samples", "1", "--length", "256", "--tasks",
                "niah_single_1", "--max-new-tokens", "48", "--window", "16", "--url", compacting.url)
        has(r, "arms", "window", "max_new_tokens", "prefix_cache")
        for arm in ("full", "kvzap@manifest", "streamingllm@manifest"):
            has(r["arms"][arm], "score", "token_agreement_with_full", "kept_fraction", "slots_freed_per_request")
        assert r["arms"]["full"]["token_agreement_with_full"] == 1.0 and 0 < r["arms"]["kvzap@manifest"]["kept_fraction"] < 1

        compacting = shared_server("compacting", hybrid)
        r = run("bench_scoring_cost.py", "--contexts", "256", "--kvzip-contexts", "256", "--url", compacting.url)
        has(r["gatesight"]["256"], "prefill_s", "capture_s", "signals_s", "score_select_s", "compact_s",
            "scoring_frac_of_prefill", "scoring_plus_compaction_frac_of_prefill", "kept_entries")
        has(r["kvzip"]["256"], "hf_prefill_s", "second_pass_s", "second_pass_frac_of_prefill")

        # Prefilled in chunks of CHUNK tokens on the shared chunked server, and again in one chunk on the
        # compacting one for the keep-sets; p = 0.5 keeps the sessions-per-pool count short.
        chunked, compacting = shared_server("chunked", hybrid), shared_server("compacting", hybrid)
        n = CHUNK + 256
        r = run("bench_compaction.py", "--context", str(n), "--keep-fraction", "0.5", "--check-chunking",
                "--url", f"server={chunked.url}", "--url", f"one_chunk={compacting.url}", timeout=600)
        has(r, "model", "context_tokens", "keep_fraction", "prefill_s", "policies", "compacted_sessions_fit",
            "uncompacted_sessions_fit", "sessions_ratio", "store_slots")
        assert r["context_tokens"] == n and r["compacted_sessions_fit"] > r["uncompacted_sessions_fit"] > 0
        for policy in ("gatesight", "kvzip", "keydiff"):
            has(r["policies"][policy], "scoring_plus_compaction_frac_of_prefill", "freed_vs_theoretical", "slots", "child_s")
        # H2O's column sums are held per KV head: n tokens x 2 KV heads x 2 attention layers x 4 bytes.
        assert r["policies"]["h2o"]["recorded_signal_bytes"] == n * 2 * 2 * 4 < r["full_context_all_layers_f32_bytes_computed"]
        assert r["policies"]["gatesight"]["recorded_signal_bytes"] > 0
        # really chunked, and the pool reported is the server's (uncompacted_sessions_fit is computed from it)
        assert r["chunked_prefill_size"] == CHUNK < n and r["pool_tokens"] == chunked.stats()["kv_pool_total_tokens"]
        assert r["uncompacted_sessions_fit"] == r["pool_tokens"] // n
        for policy, row in r["policies"].items():
            assert row["keep_set_overlap_with_one_chunk"] >= 0.99, policy

        compacting, sparse = shared_server("compacting", hybrid), shared_server("sparse", hybrid)
        r = run("bench_sparse_attention.py", "--length", "512", "--samples", "1", "--tasks", "niah_single_1",
                "--budget", str(SPARSE_BUDGET), "--index-fractions", "0.5", "--index-lengths", "512,1024",
                "--scan-lengths", "1024,2048", "--scan-rows", "1,4", "--scan-shapes", "model", "--repeats", "2",
                "--max-new-tokens", "8", "--url", f"dense={compacting.url}", "--url", f"sparse={sparse.url}")
        has(r, "accuracy", "index_sizes", "scan_per_decode_step", "regrouped_minus_sparse_full")
        assert r["budget_tokens"] == SPARSE_BUDGET
        for n in ("512", "1024"):
            index = r["index_sizes"][n]["0.5"]
            assert int(n) >= index["context_tokens"] > int(n) // 2  # the prompt holds the question too
            assert index["full_context_blocks"] == -(-index["context_tokens"] // 4) > max(index["regrouped_blocks_per_layer"]) > 0
        scans = r["scan_per_decode_step"][r["model_shape"]]["rows4"]
        assert set(scans) == {"1024", "2048", "fit_over_blocks_scanned"} and scans["2048"]["p0.5"]["index_vs_full"] == 0.5

        cell = shared_server("gated_cell", "sigmoid-rope-none")  # a dense cell test_head_eviction_e2e serves
        r = run("bench_head_decode.py", "--cell", "sigmoid-rope-none", "--prompt", "100", "--new-tokens", "20",
                "--repeats", "1", "--budget", "32", "--url", cell.url)
        has(r, "decode_seconds_per_step", "h2o_vs_plain", "keydiff_vs_plain", "reports", "pool_bytes_peak")
        assert r["reports"]["h2o"]["evicted_entries"] > 0 and r["reports"]["keydiff"]["budget"] == 32

        # --- a server of its own: a gate cell with no default step (its plain arm is plain) -------------
        r = run("bench_gate_decode.py", "--new-tokens", "80", "--repeats", "1", "--tau", "0.1")
        has(r, "decode_seconds_per_step", "gate_vs_plain", "gate_report", "memory")
        # The pool is sampled every 0.2 s: a smoke-size generation can end between two samples (CI saw 0).
        assert r["gate_report"]["folds"] == 1 and r["memory"]["pool_bytes_peak"]["gate"] >= 0

        # --- no server: the HF oracle and the kernels ---------------------------------------------------
        r = run("bench_gate_eviction.py", "--val-sequences", "2", "--test-sequences", "2", "--probe-sequences", "1",
                "--out", str(tmp_path))
        has(r, "dense_test_ppl", "validation_sweeps", "tau_star", "test_matched", "ordering", "random_probe",
            "row_sum_cv", "gates")
        assert len(r["test_matched"]) == 4 and (tmp_path / "table.csv").exists() and (tmp_path / "tau_sweep.png").exists()

        r = run("bench_allocation.py", "--tasks", "niah_single_1", "--samples", "1", "--arms", "gate,floor0.5,flat",
                "--fractions", "0.05")
        rows = {(row["arm"], row["keep_fraction"]): row for row in r["rows"]}
        assert set(rows) == {("full", 1.0), ("gate", 0.05), ("floor0.5", 0.05), ("flat", 0.05)}
        gate, floor, flat = (rows[(arm, 0.05)]["mean_budget_per_layer"] for arm in ("gate", "floor0.5", "flat"))
        # Same total; the floor sits halfway between the gate's split and the flat one.
        assert abs(sum(gate) - sum(flat)) <= 1 and abs(sum(floor) - sum(flat)) <= 1 and flat[0] == flat[1]
        assert all(min(g, f) - 1 <= h <= max(g, f) + 1 for g, h, f in zip(gate, floor, flat))
        assert len(rows[("flat", 0.05)]["needle_value_entries_kept_per_layer"]) == 2

        r = run("kvzip_allocation.py", "--tasks", "niah_single_1", "--samples", "1", "--length", "256", "--fractions", "0.5")
        has(r, "scores", "per_sample", "sink")
        assert set(r["scores"]) == {"full", "flat@0.5", "global@0.5"} and all(0 <= v <= 100 for v in r["scores"].values())

        tiered = shared_server("tiered", "tiny-llama")  # the host tier on, no store reserve
        r = run("bench_tiers.py", "--lengths", "256", "--repeats", "1", "--url", tiered.url)
        has(r, "model", "keep_fraction", "lengths", "server")
        row = r["lengths"]["256"]
        has(row, "full_prefill_child_s", "reprefill_compaction_s", "child_from_pool_s", "restore_s", "child_restored_s",
            "reprefill_compaction_over_restore", "child_speedup", "host_bytes", "slots")
        assert r["server"]["pool_tokens"] == tiered.stats()["kv_pool_total_tokens"] and row["restore_s"] > 0

        r = run("count_host_syncs.py", "--context", "200", "--rows", "2", "--new-tokens", "4", "--models",
                "tiny-llama,tiny-llama:sparse")
        has(r, "per_decode_step", "over_plain_per_layer")
        assert set(r["per_decode_step"]) == {f"tiny-llama/{kind}" for kind in ("plain", "flat", "pyramidkv", "global",
                                                                               "streamingllm", "span_schedule")} | {
            f"tiny-llama:sparse/{kind}" for kind in ("plain", "flat", "pyramidkv")}
        # Block-sparse rows plan their blocks per batch: no sync of their own (issue #56)
        assert r["over_plain_per_layer"]["tiny-llama:sparse/flat"] == 0, r["per_decode_step"]

        r = run("bench_child_decode.py", "--context", "512", "--rows", "2", "--new-tokens", "24", "--repeats", "1")
        has(r, "decode_seconds_per_step", "ratio", "masked_attention_calls")
        assert set(r["ratio"]) == {"tiny-llama/flat", "tiny-llama/pyramidkv", "tiny-llama/global", "tiny-llama/streamingllm",
                                   "tiny-hybrid-deep/gate"}
        # Page tables (issue #56): no layer of any kind runs masked attention on the torch-native backend
        assert not any(r["masked_attention_calls"].values()), r["masked_attention_calls"]

        r = run("bench_cpu_extend.py", "--cases", "300+1,100+200")
        has(r, "shape", "cases")
        for row in r["cases"].values():
            has(row, "sglang_torch_native_s", "kvx_torch_native_s", "speedup", "max_abs_diff")
            assert row["max_abs_diff"] < 1e-5

        r = run("oda_local_guard.py", "--model", "weights/tiny-hybrid-deep", "--tasks", "niah_single_1",
                "--samples", "1", "--length", "512", "--new-tokens", "8", "--arms", "full,local,head,guard:1.01",
                "--lost-steps")
        has(r, "arms", "lost_steps", "seed")
        assert r["arms"]["full"]["full_rate"] == 1.0 and r["arms"]["local"]["full_rate"] == 0.0
        # a guard above any probability sends every step Full: plain decoding
        assert r["arms"]["guard:1.01"] == r["arms"]["full"]
        for arm in r["arms"].values():
            has(arm, "score", "full_rate", "gap_share")
    finally:
        print(f"[perf smoke] seconds per script (total {sum(seconds.values()):.0f}): {json.dumps(seconds)}")
