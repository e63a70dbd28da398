"""SGLang's GPU defaults, proven on CPU (issue #54): captured graphs, the overlap scheduler, the resolution
an H100 gets, kernels checked at start and contained when they fail.

- Graphs: a shared "GPU defaults" server per demo model runs SGLang's graph runners emulated
  (``SGLANG_KVX_EMULATE_GRAPHS=1``, ``adapter/graph_replay.py`` says what that reproduces: a replay runs
  no plugin Python but SGLang's eager bodies) with a breakable prefill graph, as CUDA's default. Every
  policy keeps exactly the entries, and every child answers exactly what, the eager compacting server
  keeps and answers (one policy per way of scoring in the suite, all 13 in the long tier); On-Demand Attention serves batches where every row runs Full (batch size 1 and 3);
  plain rows and children of flat contexts replay graphs (counted); batches of children of every allocation
  and of StreamingLLM rows replay the decode graph's page-table variant (issue #56 item 4), token for token
  as the eager server answers; the learned-gate family starts and serves.
- Overlap: the dense GPU-defaults server also runs the overlap scheduler (``SGLANG_KVX_CPU_OVERLAP=1``):
  the combination matrix's features and the dense compaction oracle tests answer token for token as
  on the compacting server (overlap off). Its other matrix modes with overlap on run in the long tier.
- Resolution: ``tests/cuda_standin.py`` resolves every row of the table in ``docs/deployment.md``
  as SGLang does on an H100 with CUDA 13.0; the table must say what it resolves, and each setting the
  plugin turns off comes with one log line.
- Kernels: the ``gpu`` extra's CuPy is built for the CUDA of the torch SGLang pins; a kernel failing its
  start-up check, or inside a forward on a served CPU server (``tests/throwaway_raising_op.py``), is
  replaced by its torch reference with the request answered.
- A recording that missed layers leaves its parent uncompacted with the reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import requests
import torch

from sglang_kvx.policies import servable_policy_names
from sglang_kvx.adapter.graph_tables import PAGE_TABLES
from sglang_kvx.serve.graph_eligibility import PER_LAYER, RECORDING, STEP_OUTPUTS, STEP_SPAN

from server_pool import spec
from test_compaction_e2e import GREEDY, served_keep_set, text

ROOT = Path(__file__).resolve().parents[1]
EMULATE = {"SGLANG_KVX_EMULATE_GRAPHS": "1"}
OVERLAP = {"SGLANG_KVX_CPU_OVERLAP": "1"}
RAISING = {"SGLANG_KVX_OPS_IMPL": "state_snapshot=raising"}  # tests/throwaway_raising_op.py's kernel


def gpu_defaults_spec(base, dense: bool):
    """The compacting server's launch, with SGLang's GPU defaults: graphs (emulated) with a breakable prefill
    graph, and on the dense model the overlap scheduler (a hybrid's GDN caching pairs it with overlap off);
    on the hybrid a state-snapshot kernel that fails inside forwards."""
    args = list(base.args)
    modules = args.index("--kvx-policy-modules") + 1
    args[modules] += ",throwaway_raising_op"
    env = {**dict(base.env), **EMULATE, **(OVERLAP if dense else RAISING)}
    return spec(base.model_path, *args, "--cuda-graph-backend-prefill", "breakable", max_total_tokens=base.max_total_tokens,
                env=env)


@pytest.fixture(scope="module", params=["tiny-hybrid-deep", "tiny-llama"])
def demo_model(request) -> str:
    """conftest's, the hybrid first: the dense model's graph tests then run right before this file's
    dense-only tests (overlap, kernels), so its two servers are started once."""
    return request.param


@pytest.fixture
def gpu_defaults(shared_specs, server_pool):
    """``gpu_defaults(model)``: (the GPU-defaults server, the eager compacting server) of a demo model."""
    def servers(model: str):
        base = shared_specs("compacting", model)
        return (server_pool.get(gpu_defaults_spec(base, model == "tiny-llama")),
                server_pool.get(base, hot=True))

    return servers


def body(ids, new, **kvx) -> dict:
    params = {**GREEDY, "max_new_tokens": new}
    if kvx:
        params["custom_params"] = {"kvx": kvx}
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


def send(server, payload) -> tuple[int, dict | str]:
    response = server.generate(payload, timeout=300)
    return response.status_code, response.json() if response.status_code == 200 else response.text[:300]


def graph_stats(server) -> dict:
    stats = server.stats()
    return {"replays": dict(stats.get("graph_replays", {})), "declines": dict(stats.get("graph_declines", {})),
            "incomplete": stats["compactions_failed_incomplete_recording"]}


def grew(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


# --- graphs --------------------------------------------------------------------------------------


# The suite compares one policy of each way a parent is scored -- GDN signals and output gates recorded in
# the forward (GateSight; refused by name on the dense model, alike on both servers), attention recorded
# (SnapKV), hidden states scored chunk by chunk (KVzap), the pool read after the prefill (KeyDiff), a
# second pass of internal requests (KVzip, dense) -- and the long tier every servable policy on both models.
# (policies, how many of them compact at once: KVzip's parent compacts after its second pass, and its child's
# answer is compared, not its kept entries)
IN_SUITE = {"tiny-llama": (("gatesight", "snapkv", "kvzap", "keydiff", "kvzip"), 3),
            "tiny-hybrid-deep": (("gatesight", "snapkv", "kvzap", "keydiff"), 4)}


@pytest.mark.slow
def test_every_policy_keeps_and_answers_under_graphs_as_eagerly(demo_model, gpu_defaults, references):
    """Each servable policy compacts the same context on both servers: the same kept entries per layer and
    head, the same child tokens, or the same refusal; no parent is ever compacted from a partial recording.
    Recording parents are declined; plain rows and children of flat contexts replay the decode and prefill
    graphs, a PyramidKV child's decode the page-table variant."""
    policies, compacting_at_once = IN_SUITE[demo_model]
    every_policy_alike(demo_model, gpu_defaults, references, policies, compared_at_least=compacting_at_once)


@pytest.mark.slow
@pytest.mark.long
def test_every_servable_policy_keeps_and_answers_under_graphs_as_eagerly(demo_model, gpu_defaults, references):
    every_policy_alike(demo_model, gpu_defaults, references, servable_policy_names(), compared_at_least=8)


def every_policy_alike(demo_model, gpu_defaults, references, policies, compared_at_least: int) -> None:
    graphs, eager = gpu_defaults(demo_model)
    ref = references[demo_model]
    context, question = ref.encode(text(160, seed=541)), ref.encode(" which word comes next?")
    start = graph_stats(graphs)
    compared = []
    for policy in policies:
        answers = []
        for server in (graphs, eager):
            server.flush()
            parent = send(server, body(context, 0, policy=policy, keep_fraction=0.5))
            kept = served_keep_set(server, len(context), policy, 0.5) if parent[0] == 200 and \
                parent[1]["meta_info"]["kvx"][-1].get("compacted") else None
            child = send(server, body(context + question, 6, policy=policy, keep_fraction=0.5))
            answers.append((parent[0], kept, child[0], child[1]["output_ids"] if child[0] == 200 else child[1]))
        (p1, k1, c1, o1), (p2, k2, c2, o2) = answers
        assert (p1, c1, o1) == (p2, c2, o2), (policy, answers)
        assert (k1 is None) == (k2 is None), policy
        if k1 is not None:
            assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) if not isinstance(a, list)
                       else all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(k1, k2)), policy
            compared.append(policy)
    assert len(compared) >= compared_at_least, compared
    after = graph_stats(graphs)
    assert after["incomplete"] == start["incomplete"]
    assert grew(start["declines"], after["declines"], RECORDING) >= 2  # snapkv, pyramidkv, h2o, gatesight ... parents
    # A plain request and a child of a flat (KNorm) context replay both graphs (the plain decode variant); a
    # PyramidKV child's decode replays the page-table variant, its question's extend the breakable prefill graph.
    for kvx, variant in (({}, "plain"), ({"policy": "knorm", "keep_fraction": 0.5}, "plain"),
                         ({"policy": "pyramidkv", "keep_fraction": 0.5}, PAGE_TABLES)):
        graphs.flush()
        if kvx:
            assert send(graphs, body(context, 0, **kvx))[0] == 200
        before = graph_stats(graphs)
        status, answer = send(graphs, body(context + question, 8, **kvx))
        assert status == 200
        after = graph_stats(graphs)
        decode, prefill = grew(before["replays"], after["replays"], "decode"), grew(before["replays"], after["replays"], "prefill")
        print(f"[graphs] {demo_model} {kvx or 'plain'}: {decode} decode and {prefill} prefill replays; "
              f"declines {after['declines']}")
        assert decode >= 7 and grew(before["replays"], after["replays"], f"decode[{variant}]") == decode, (kvx, after)
        assert prefill >= 1, (kvx, before, after)


@pytest.mark.slow
def test_on_demand_attention_serves_batches_where_every_row_runs_full_under_graphs(demo_model, gpu_defaults, references):
    """theta below every score: each step's Local attempt is re-run Full with the forward's final hidden
    states captured. Alone (batch size 1) and three at once the server answers plain greedy decoding, and
    lives (on CUDA the replay of such a batch raised in SGLang's load_batch and ended the scheduler)."""
    graphs, eager = gpu_defaults(demo_model)
    ref = references[demo_model]
    prompt = ref.encode(text(60, seed=62))
    oda = {"decode": {"step": "oda", "sinks": 2, "window": 16, "theta": -1e6}}
    plain = send(eager, body(prompt, 12))[1]
    before = graph_stats(graphs)
    alone = send(graphs, body(prompt, 12, **oda))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda _: send(graphs, body(prompt, 12, **oda)), range(3)))
    for status, answer in [alone, *together]:
        assert status == 200, answer
        assert answer["output_ids"] == plain["output_ids"]
        assert answer["meta_info"]["kvx"][-1]["full_rate"] == 1.0
    after = graph_stats(graphs)
    assert grew(before["declines"], after["declines"], STEP_OUTPUTS) >= 11 * 4  # every step of the four, at least



# Rows whose layers read other than their whole rows, by kind: (the parent's kvx fields, or None: no parent; each
# row's kvx fields). Issue #56 item 4: their decode batches replay the page-table graph variant.
KEPT_IN_GRAPHS = {
    "pyramidkv": ({"policy": "keydiff", "keep_fraction": 0.5, "allocation": "pyramidkv"}, None),
    "global": ({"policy": "keydiff", "keep_fraction": 0.3, "allocation": "global"}, None),
    "gate": ({"policy": "gatesight", "keep_fraction": 0.3, "allocation": "gate"}, None),
    "streamingllm": (None, {"decode": {"step": "streamingllm", "sinks": 4, "window": 24}}),
    "span_schedule": (None, {"decode": {"step": "span_schedule", "sinks": 4, "window": 24, "full_every": 3}}),
}
# GateSight's output-gate allocation is the hybrid's; span_schedule's re-runs snapshot recurrent states, and the
# hybrid GPU-defaults server's snapshot kernel is the failing one whose fallback the kernel-failure test owns.
ONLY_ON = {"gate": "tiny-hybrid-deep", "span_schedule": "tiny-llama"}


@pytest.mark.slow
def test_batches_of_children_of_every_allocation_and_streamingllm_rows_replay_graphs_as_eagerly(
        demo_model, gpu_defaults, references):
    """Four rows of each kind decoding together replay the decode graph's page-table variant (counted; none
    declined for per-layer lengths or spans) and answer token for token what the eager server answers."""
    graphs, eager = gpu_defaults(demo_model)
    ref = references[demo_model]
    context = ref.encode(text(160, seed=811))
    new = 10
    for kind, (parent, fields) in KEPT_IN_GRAPHS.items():
        if ONLY_ON.get(kind, demo_model) != demo_model:
            continue
        prompts = [(context if parent else ref.encode(text(80, seed=820 + row))) + ref.encode(text(6, seed=830 + row))
                   for row in range(4)]
        answers, before = [], graph_stats(graphs)
        for server in (graphs, eager):
            server.flush()
            if parent is not None:
                assert send(server, body(context, 0, **parent))[0] == 200
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda ids: send(server, body(ids, new, **(parent or fields))), prompts))
            assert all(status == 200 for status, _ in replies), (kind, replies)
            if parent is not None:
                assert all(reply["meta_info"]["kvx"][-1].get("child") for _, reply in replies), kind
            answers.append([reply["output_ids"] for _, reply in replies])
        after = graph_stats(graphs)
        replayed = grew(before["replays"], after["replays"], f"decode[{PAGE_TABLES}]")
        print(f"[graphs] {demo_model} {kind}: {replayed} page-table replays; declines {after['declines']}")
        assert answers[0] == answers[1], kind
        assert replayed >= new - 1, (kind, before, after)
        assert grew(before["declines"], after["declines"], STEP_SPAN) == 0, (kind, after)
        assert grew(before["declines"], after["declines"], PER_LAYER) == 0, (kind, after)
        if parent is not None:  # the children's questions: the breakable prefill graph, their layers planned eagerly
            assert grew(before["replays"], after["replays"], "prefill") >= 1, (kind, after)


@pytest.mark.slow
@pytest.mark.parametrize("demo_model", ["tiny-hybrid-deep"], indirect=True)  # run beside the hybrid's servers
def test_a_kernel_failing_inside_a_forward_falls_back_and_the_request_is_answered(demo_model, gpu_defaults, references):
    """The hybrid GPU-defaults server runs ``tests/throwaway_raising_op.py``'s state snapshot, which passes
    its start-up check and raises on the server's states: On-Demand Attention rows re-running every step
    Full (each re-run snapshots and restores the recurrent states inside the forward) are answered as plain
    greedy decoding on the eager server, the scheduler lives on, the failure is counted and logged once."""
    graphs, eager = gpu_defaults(demo_model)
    ref = references[demo_model]
    prompt = ref.encode(text(60, seed=93))
    oda = {"decode": {"step": "oda", "sinks": 2, "window": 16, "theta": -1e6}}
    got, want = send(graphs, body(prompt, 8, **oda)), send(eager, body(prompt, 8))
    assert got[0] == want[0] == 200, (got, want)
    assert got[1]["output_ids"] == want[1]["output_ids"] and got[1]["meta_info"]["kvx"][-1]["full_rate"] == 1.0
    fallen = graphs.stats()["op_fallbacks"]
    assert fallen["state_snapshot"]["impl"] == "raising" and fallen["state_snapshot"]["where"] == "forward"
    assert "injected kernel failure" in fallen["state_snapshot"]["error"]
    assert send(graphs, body(prompt, 4))[0] == 200  # still serving
    log = Path(graphs.log_path).read_text()
    assert log.count("op state_snapshot: the raising implementation failed") == 1

# --- overlap -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_overlap_serves_the_combination_matrix_as_overlap_off(gpu_defaults, references):
    """Every feature of the combination matrix on the dense GPU-defaults server (overlap on, graphs) answers
    what the compacting server (overlap off, eager) answers, alone and beside three other requests."""
    from test_combinations import _features, _noise, _send

    graphs, eager = gpu_defaults("tiny-llama")
    ref = references["tiny-llama"]
    differ = []
    for name, sends in _features(ref).items():
        results = []
        for server in (graphs, eager):
            server.flush()
            for route, payload in sends:
                result = _send(server.url, route, payload)
            results.append(result)
        if results[0] != results[1]:
            differ.append(f"{name}: overlap on {results[0]}, off {results[1]}")
        if results[0][0] == 200:
            graphs.flush()
            for route, payload in sends[:-1]:
                _send(graphs.url, route, payload)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                noise = [pool.submit(_send, graphs.url, "/generate", _noise(ref, i)) for i in range(3)]
                mixed = pool.submit(_send, graphs.url, *sends[-1]).result()
                assert all(f.result()[0] == 200 for f in noise)
            if mixed != results[1]:
                differ.append(f"{name}: overlap on in a batch {mixed}, off {results[1]}")
    assert not differ, "\n".join(differ)


@pytest.mark.slow
@pytest.mark.parametrize("policy, keep_fraction", [("snapkv", 0.3), ("pyramidkv", 0.5), ("keydiff", 0.2),
                                                   ("kvzip", 0.3), ("h2o", 0.3)])
def test_the_dense_compaction_oracle_tests_pass_with_overlap_on(gpu_defaults, references, demo_paths, oracle,
                                                               policy, keep_fraction):
    """``test_compaction_e2e``'s oracle test, run as it is on the dense GPU-defaults server."""
    from test_compaction_e2e import test_child_matches_the_oracle_with_the_same_keep_set

    graphs, _ = gpu_defaults("tiny-llama")
    graphs.flush()
    test_child_matches_the_oracle_with_the_same_keep_set(("tiny-llama", graphs, references["tiny-llama"]), policy,
                                                         keep_fraction, demo_paths, oracle)


OVERLAP_MODES = ("chunked", "sparse", "plain", "paged", "gated")  # the matrix's other modes overlap stays on for


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mode", OVERLAP_MODES)
def test_every_matrix_mode_serves_alike_with_overlap_on(mode, shared_specs, server_pool, references, demo_paths):
    """The combination matrix of every other mode whose resolution keeps the overlap scheduler, run with it on."""
    from test_combinations import GATED_CELL, _Tokenizer, check_matrix

    if mode == "paged":
        from test_paged_kv_e2e import paged_spec

        base, ref = paged_spec(demo_paths["tiny-llama"]), references["tiny-llama"]
    elif mode == "gated":
        from gated_cells import cell_path
        from test_gate_eviction_e2e import gated_spec

        base, ref = gated_spec(GATED_CELL), _Tokenizer(cell_path(GATED_CELL))
    else:
        base, ref = shared_specs(mode, "tiny-llama"), references["tiny-llama"]
    server = server_pool.get(spec(base.model_path, *base.args, max_total_tokens=base.max_total_tokens,
                                  env={**dict(base.env), **OVERLAP}))
    check_matrix(f"{mode} (overlap on)", server, ref)


# --- resolution on an H100 ------------------------------------------------------------------------


def deployment_table() -> list[dict]:
    """The rows of docs/deployment.md's table of SGLang's GPU defaults per mode."""
    text_ = (ROOT / "docs" / "deployment.md").read_text()
    section = text_.split("## SGLang's GPU defaults per mode", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]


def test_resolution_on_an_h100_is_the_deployment_tables(tmp_path):
    """Every mode's resolution on a stand-in H100 (sm90, CUDA 13.0: ``tests/cuda_standin.py``) against the
    table: attention backend, decode graph (its largest batch), prefill graph (its largest token bucket),
    overlap, GDN state caching, page size, and what the plugin declares, one log line each."""
    rows = deployment_table()
    assert len(rows) >= 30
    lines = "".join(json.dumps(row["flags"].strip("`").replace("{context_dir}", str(tmp_path / "contexts")).split()) + "\n"
                    for row in rows)
    answers = subprocess.run([sys.executable, str(ROOT / "tests" / "cuda_standin.py")], input=lines, text=True,
                             capture_output=True, timeout=600, cwd=ROOT, env={**os.environ, "KVX_STANDIN_DEVICES": "2"})
    assert answers.returncode == 0, answers.stderr[-2000:]
    problems = []
    for row, line in zip(rows, answers.stdout.splitlines()):
        answer = json.loads(line)
        if "resolved" not in answer:
            problems.append(f"{row['mode']}: {answer['error']}")
            continue
        got = answer["resolved"]

        def graph(kind: str, size: str) -> str:
            return got[kind] if got[kind] == "disabled" else f"{got[kind]} ({got[size]})"

        seen = {"attention": got["attention_backend"], "decode graph": graph("decode_graph", "decode_graph_max_bs"),
                "prefill graph": graph("prefill_graph", "prefill_graph_max_tokens"),
                "overlap": "on" if got["overlap"] else "off",
                "GDN caching": "-" if got["mamba_radix_cache_strategy"] == "auto" else got["mamba_radix_cache_strategy"],
                "page": str(got["page_size"]),
                "the plugin declares": ", ".join(sorted(source.split(":", 1)[1] for source, _ in got["declared"])) or "-"}
        for column, value in seen.items():
            if row[column].strip("`") != value:
                problems.append(f"{row['mode']}: {column} is {value!r} on the stand-in H100, the table says {row[column]!r}")
        turned_off = [source for source, _ in got["declared"] if source != "sglang_kvx:gated_model"]
        said = [line for line in answer["plugin_log"] if " off" in line]
        if len(said) != len(turned_off):
            problems.append(f"{row['mode']}: declared {turned_off}, logged {said}")
    assert not problems, "\n".join(problems)
    assert len(answers.stdout.splitlines()) == len(rows)


# --- kernels -------------------------------------------------------------------------------------


def test_the_gpu_extras_cupy_is_built_for_the_cuda_of_the_torch_sglang_pins():
    from importlib.metadata import requires, version

    pin = next(r for r in requires("sglang") if re.match(r"torch\s*==", r))
    assert version("torch").split("+")[0] == pin.split("==")[1].strip()  # the torch installed is the one pinned
    major = torch.version.cuda.split(".")[0]  # of the installed (pinned) build
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    cupy = [e for e in extras if e.startswith("cupy-cuda")]
    assert cupy and all(re.match(rf"cupy-cuda{major}x\b", e) for e in cupy), (extras, torch.version.cuda)


def test_a_kernel_failing_its_start_up_check_is_replaced_by_its_reference(monkeypatch):
    """The warm-up runs each chosen kernel once on tiny shapes against the torch reference: one that raises
    and one that answers wrong both fall back before any request, and the op then answers as the reference."""
    from sglang_kvx.ops import dispatch
    from sglang_kvx.ops.gatesight import mlp_utility_reference
    from sglang_kvx.ops.prefix_attention import prefix_cells_attention_reference
    from sglang_kvx.ops.warmup import CASES, warm_up

    monkeypatch.setattr(dispatch, "_FALLEN_BACK", {})
    monkeypatch.setattr(dispatch, "OPS", dict(dispatch.OPS))
    monkeypatch.setattr(dispatch, "_EXTRA", {})

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    def wrong(*args):
        return prefix_cells_attention_reference(*args) + 1.0

    dispatch.register_implementation("window_attention", "broken", broken)
    dispatch.register_implementation("prefix_attention", "wrong", wrong)
    dispatch.register_implementation("gatesight_utility", "same", mlp_utility_reference)  # a kernel that agrees
    monkeypatch.setenv(dispatch.ENV, "window_attention=broken,prefix_attention=wrong,gatesight_utility=same")
    dispatch._parse.cache_clear()
    report = {entry["op"]: entry for entry in warm_up(["window_attention", "prefix_attention", "gatesight_utility"],
                                                       torch.device("cpu"))}
    dispatch._parse.cache_clear()
    assert not report["window_attention"]["ok"] and "no kernel image" in report["window_attention"]["error"]
    assert not report["prefix_attention"]["ok"] and report["prefix_attention"]["max_abs_err"] >= 1.0
    assert report["gatesight_utility"]["ok"]
    fell = dispatch.fallbacks()
    assert set(fell) == {"window_attention", "prefix_attention"}
    assert {entry["where"] for entry in fell.values()} == {"warm-up"}
    assert dispatch.choose("window_attention", None, torch.device("cpu")) == "torch"
    case, _ = CASES["window_attention"](torch.device("cpu"))
    assert torch.equal(case(None), case("torch"))  # auto now answers as the reference


# --- a recording that missed layers ---------------------------------------------------------------


class _Pool:
    num_layers, num_kv_heads, head_dim, device, has_state = 3, 2, 8, torch.device("cpu"), False

    def row(self, row, length):
        return torch.arange(length)

    def read_keys(self, layer, slots):
        return torch.zeros(len(slots), 2, 8)


class _Batch:
    is_extend, is_decode = True, False

    def __init__(self, start: int, length: int) -> None:
        from sglang_kvx.ports import Segment

        self.rows, self.segments = [4], [Segment(index=0, row=4, start=0, length=length, prefix_len=start)]


def test_a_recording_that_missed_layers_leaves_its_parent_uncompacted_with_the_reason():
    """A prefill chunk whose forward ran without the plugin's hooks (a replay) hands over nothing: the
    recording counts fewer tokens in its layers than its row ran, and the parent is not compacted from it."""
    from types import SimpleNamespace

    from sglang_kvx.serve.parent_compaction import ParentCompaction
    from sglang_kvx.settings import CompactionSettings
    from sglang_kvx.signals import CaptureSpec
    from sglang_kvx.signals.recorder import IncompleteRecording, SignalRecorder
    from sglang_kvx.store import ContextStore

    recorder = SignalRecorder(_Pool(), 4, lambda: torch.ones(4))
    for chunks_hooked in ((True, True), (True, False)):
        recorder.start(4, 64, CaptureSpec(window=4, column_sums=True))
        for (start, hooked) in zip((0, 32), chunks_hooked):
            batch = _Batch(start, 32)
            recorder.expect(batch)  # told before every forward, graphs or not
            if hooked:
                for layer in range(3):
                    recorder.attention(layer, torch.randn(32, 4 * 8), batch, 4, 8, 0.35)
        recording = recorder.recordings[4]
        if all(chunks_hooked):
            assert recording.incomplete() is None
            recorder.take(4)
            continue
        assert "whole in 0 of 3 layers for the 64 tokens" in recording.incomplete()
        with pytest.raises(IncompleteRecording):
            recording.fill(SimpleNamespace())
    failures = []
    parents = ParentCompaction(_Pool(), ContextStore(), None, recorder, None, None, failures.append, None, 2)
    request = SimpleNamespace(row=4, input_ids=list(range(64)))
    state = SimpleNamespace(settings=CompactionSettings("snapkv", 0.5, 0, "flat"), outcome=None,
                            fields=SimpleNamespace(tenant=None))
    parents.compact(request, state)
    assert state.outcome["compacted"] is False and "stays uncompacted" in state.outcome["reason"]
    assert parents.incomplete_recordings == 1 and failures == [state.outcome["reason"]]


# Last in the file: its two gate-cell servers would otherwise stop the dense GPU-defaults pair for room
# between the graph tests and the overlap tests (the pool keeps three servers per worker).
@pytest.mark.slow
def test_the_learned_gate_family_starts_and_serves_under_graph_emulation(server_pool):
    """Its attention backend (torch-native's kin) cannot be captured: the plugin declares graphs off for it
    as SGLang does for torch_native, so the server starts and serves, with no replay, as without emulation."""
    from gated_cells import cell_path
    from test_gate_eviction_e2e import gated_spec

    base = gated_spec("sigmoid-rope-gate")
    emulated = server_pool.get(spec(base.model_path, *base.args, max_total_tokens=base.max_total_tokens, env=EMULATE))
    plain = server_pool.get(base)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(cell_path("sigmoid-rope-gate")).encode(text(80, seed=71), add_special_tokens=False)
    answers = [send(server, body(ids, 10)) for server in (emulated, plain)]
    assert answers[0][0] == answers[1][0] == 200
    assert answers[0][1]["output_ids"] == answers[1][1]["output_ids"]
    assert "graph_replays" not in emulated.stats()


def test_on_demand_attentions_mechanism_lives_in_its_step():
    """Item 7: what ODA needs from the forward and the server it declares on its step
    (``DecodeStep.forward_outputs``, ``load_resources``); the runtime, the adapter and the config name none of it."""
    package = ROOT / "sglang_kvx"
    places = [*(package / "serve").rglob("*.py"), *(package / "adapter").rglob("*.py"), package / "config.py"]
    found = [f"{path.relative_to(ROOT)}: {word}" for path in places for word in ("prev_hidden", "recall_head", "reads_hidden")
             if word in path.read_text()]
    assert not found, found
