"""The kernel layer on a GPU: every Triton kernel against its torch reference, with timings.

    python3 perf/gpu_check.py                               # a CUDA machine; needs only torch and triton
    TRITON_INTERPRET=1 python perf/gpu_check.py --smoke     # tiny sizes on CPU (the test suite runs this)

Prints one JSON line per op check, then a last line with the verdict: per op and case the largest
absolute difference from the torch reference against its tolerance (float32 1e-4; bfloat16 outputs 3e-2; block choice: at most 1% of
ids differing, float ties) and, on CUDA, the median time of the kernel and of the reference
(ratios within one run); then every served policy's capture -> score -> allocate -> select ->
compact path (the server's recorder and compactor over a pool of plain device tensors, signals
fed chunk by chunk as the adapter does) against the same run on the CPU, with GateSight's
scoring time; then GateSight's scoring against a lower bound on a prefill at Qwen3-Next's layer shape
at 32K, 64K and 128K tokens (``gatesight_cost``; the seed reports 1.0-1.4%). Exits 1 when any
check is over its tolerance. On CUDA also, per op: the host syncs one call makes
(``torch.cuda.set_sync_debug_mode``) and whether it captures into a ``torch.cuda.graph`` and replays the
eager result; bf16 state snapshots and windowed attention; and everywhere the server's start-up check of
every op (``sglang_kvx/ops/warmup.py``; with ``--smoke`` each op's Triton kernel under the interpreter).
``--plant`` runs the GateSight
MLP check with a planted wrong kernel (its output bias dropped) to show a mismatch fails the script.
Written to be the one short script a session with a lent GPU runs first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, without installing it

from sglang_kvx.ops.gatesight import mlp_utility  # noqa: E402
from sglang_kvx.ops.gated_attention import FoldedKeys, gated_attention  # noqa: E402
from sglang_kvx.ops.prefix_attention import prefix_cells_attention  # noqa: E402
from sglang_kvx.ops.block_sparse import (  # noqa: E402
    block_sparse_attention, compress_blocks, row_blocks, select_blocks)
from sglang_kvx.ops.dispatch import cupy_available, flashinfer_available  # noqa: E402
from sglang_kvx.ops.flashinfer_plans import flashinfer_shapes  # noqa: E402
from sglang_kvx.ops.state_snapshot import restore_states, snapshot_states  # noqa: E402
from sglang_kvx.ops.window_attention import window_attention  # noqa: E402


def _flashinfer_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return q.is_cuda and flashinfer_available() and flashinfer_shapes(q, k_cache, v_cache) is None


def timed(fn, device: torch.device, repeats: int) -> tuple[torch.Tensor, float | None]:
    out = fn()
    if device.type != "cuda":
        return out, None
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def prefix_case(batch: int, seq_len: int, q_len: int, prefix: int, hidden: int, extras: int,
                heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> dict:
    """Children of one folded context: rows of ``seq_len`` slots whose first ``prefix`` are the
    context's; the layer hides the last ``hidden`` of them and borrows ``extras`` entries."""
    g = torch.Generator().manual_seed(seed)
    pool = batch * seq_len + prefix
    shared = torch.arange(prefix)
    own = torch.randperm(pool - prefix, generator=g) + prefix
    rows = [torch.cat([shared, own[b * (seq_len - prefix) : (b + 1) * (seq_len - prefix)]]) for b in range(batch)]
    return dict(
        q=torch.randn(batch * q_len, heads, dim, generator=g).to(dtype),
        k_cache=torch.randn(pool, kv_heads, dim, generator=g).to(dtype),
        v_cache=torch.randn(pool, kv_heads, dim, generator=g).to(dtype),
        req_to_token=torch.stack(rows).to(torch.int32),
        rows=torch.arange(batch), seq_lens=torch.full((batch,), seq_len), q_lens=torch.full((batch,), q_len),
        hidden_from=torch.full((batch,), prefix - hidden), hidden_to=torch.full((batch,), prefix),
        extra_k=torch.randn(batch * extras, kv_heads, dim, generator=g).to(dtype),
        extra_v=torch.randn(batch * extras, kv_heads, dim, generator=g).to(dtype),
        extra_indptr=torch.arange(batch + 1) * extras,
        scaling=dim ** -0.5,
    )


def check_prefix_attention(name: str, device: torch.device, repeats: int, **shape) -> dict:
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in prefix_case(**shape).items()}
    got, triton_s = timed(lambda: prefix_cells_attention(**case, impl="triton"), device, repeats)
    want, torch_s = timed(lambda: prefix_cells_attention(**case, impl="torch"), device, repeats)
    return {"case": name, **{k: v for k, v in shape.items() if k != "dtype"}, "dtype": str(shape["dtype"]),
            "max_abs_err": float((got.float() - want.float()).abs().max()), "tolerance": tolerance(shape["dtype"]),
            "triton_s": triton_s, "torch_reference_s": torch_s,
            "speedup": round(torch_s / triton_s, 2) if triton_s else None}


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def check_mlp_utility(device: torch.device, repeats: int, n: int, layers: int = 2, heads: int = 2,
                      plant: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    features = torch.randn(layers, n, 75, generator=g).to(device)
    w1 = (torch.randn(layers, heads, 75, 64, generator=g) / 8).to(device)
    b1, w2 = torch.randn(layers, heads, 64, generator=g).to(device), torch.randn(layers, heads, 64, generator=g).to(device)
    b2 = torch.randn(layers, heads, generator=g).to(device)
    planted_b2 = torch.zeros_like(b2) if plant else b2  # --plant: a kernel that forgets the output bias
    got, triton_s = timed(lambda: mlp_utility(features, w1, b1, w2, planted_b2, impl="triton"), device, repeats)
    want, torch_s = timed(lambda: mlp_utility(features, w1, b1, w2, b2, impl="torch"), device, repeats)
    return {"case": f"gatesight_mlp n={n}" + (" (planted wrong kernel)" if plant else ""),
            "max_abs_err": float((got - want).abs().max()), "tolerance": 1e-4,
            "triton_s": triton_s, "torch_reference_s": torch_s,
            "speedup": round(torch_s / triton_s, 2) if triton_s else None}


def check_gated_attention(name: str, device: torch.device, repeats: int, kind: str, batch: int, seq_len: int,
                          heads: int, dim: int, folded_len: int, tau: float = 0.1) -> dict:
    """The learned-gate family's decode attention: gate-scaled keys, tau deletions, a folded stretch."""
    g = torch.Generator().manual_seed(2)
    pool = batch * (seq_len + folded_len) + 1
    r2t = (torch.randperm(pool - 1, generator=g)[: batch * seq_len] + 1).view(batch, seq_len).to(torch.int32)
    extras = batch * folded_len
    folded = FoldedKeys(torch.full((batch,), 2), torch.full((batch,), 2 + folded_len), torch.randn(extras, heads, dim, generator=g),
                        torch.randn(extras, heads, dim, generator=g), torch.rand(extras, generator=g), torch.arange(batch + 1) * folded_len)
    case = dict(q=torch.randn(batch, heads, dim, generator=g), k_cache=torch.randn(pool, heads, dim, generator=g),
                v_cache=torch.randn(pool, heads, dim, generator=g), key_gate=torch.rand(pool, generator=g), req_to_token=r2t,
                rows=torch.arange(batch), seq_lens=torch.full((batch,), seq_len), q_lens=torch.ones(batch, dtype=torch.long),
                q_positions=torch.full((batch,), seq_len - 1), tau=torch.full((batch,), tau), kind=kind, scaling=dim ** -0.5)
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    folded = FoldedKeys(*(x.to(device) for x in (folded.hidden_from, folded.hidden_to, folded.keys, folded.values,
                                                  folded.gates, folded.indptr)))
    got, triton_s = timed(lambda: gated_attention(**case, folded=folded, impl="triton"), device, repeats)
    want, torch_s = timed(lambda: gated_attention(**case, folded=folded, impl="torch"), device, repeats)
    return {"case": name, "max_abs_err": float((got.float() - want.float()).abs().max()), "tolerance": 1e-4,
            "triton_s": triton_s, "torch_reference_s": torch_s, "speedup": round(torch_s / triton_s, 2) if triton_s else None}


def check_block_sparse(device: torch.device, repeats: int, n: int, queries: int, heads: int, kv_heads: int, dim: int,
                       budget_blocks: int, dtype: torch.dtype) -> list[dict]:
    """Block-sparse attention's three steps over one row of ``n`` entries, its last ``queries`` as queries."""
    g = torch.Generator().manual_seed(3)
    pool = n + 17
    slots = torch.randperm(pool - 1, generator=g)[:n] + 1
    block_slots, block_positions = (t.to(device) for t in row_blocks(slots))
    k_cache = torch.randn(pool, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(pool, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(queries, heads, dim, generator=g).to(device, dtype)
    q_positions = torch.arange(n - queries, n, device=device)
    lo, hi = torch.zeros(queries, dtype=torch.long, device=device), q_positions // 4 + 1
    checks = []
    impls = ["triton"] + (["cupy"] if device.type == "cuda" and cupy_available() else [])
    want_keys, torch_s = timed(lambda: compress_blocks(k_cache, block_slots, impl="torch"), device, repeats)
    for impl in impls:
        got, impl_s = timed(lambda: compress_blocks(k_cache, block_slots, impl=impl), device, repeats)
        checks.append({"case": f"block_sparse_compress_{impl}_{n}", "max_abs_err": float((got - want_keys).abs().max()),
                       "tolerance": 1e-4 if dtype == torch.float32 else 1e-3,
                       f"{impl}_s": impl_s, "torch_reference_s": torch_s})
    want_sel, torch_s = timed(lambda: select_blocks(q, want_keys, lo, hi, budget_blocks, 1, dim ** -0.5, impl="torch"),
                              device, repeats)
    got_sel, triton_s = timed(lambda: select_blocks(q, want_keys, lo, hi, budget_blocks, 1, dim ** -0.5, impl="triton"),
                              device, repeats)
    checks.append({"case": f"block_sparse_select_{n}", "max_abs_err": float((got_sel != want_sel).float().mean()),
                   "tolerance": 0.01,
                   "note": "share of chosen block ids that differ (float ties)", "triton_s": triton_s,
                   "torch_reference_s": torch_s})
    args = (q, k_cache, v_cache, block_slots, block_positions, want_sel, q_positions, dim ** -0.5)
    want, torch_s = timed(lambda: block_sparse_attention(*args, impl="torch"), device, repeats)
    for impl in ["triton"] + (["flashinfer"] if _flashinfer_takes(q, k_cache, v_cache) else []):
        got, impl_s = timed(lambda: block_sparse_attention(*args, impl=impl), device, repeats)
        checks.append({"case": f"block_sparse_attention_{impl}_{n}", "tolerance": tolerance(dtype),
                       "max_abs_err": float((got.float() - want.float()).abs().max()), f"{impl}_s": impl_s,
                       "torch_reference_s": torch_s, "speedup": round(torch_s / impl_s, 2) if impl_s else None})
    return checks


def check_window_attention(device: torch.device, repeats: int, batch: int, seq_len: int, heads: int, kv_heads: int,
                           dim: int, sinks: int, window: int, dtype: torch.dtype) -> list[dict]:
    """On-Demand Attention's Local step: each decoding row reads its first ``sinks`` and last ``window`` keys."""
    g = torch.Generator().manual_seed(5)
    pool = batch * seq_len + 1
    req_to_token = (torch.randperm(pool - 1, generator=g) + 1).reshape(batch, seq_len).to(device, torch.int32)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=g)
    case = dict(q=torch.randn(batch, heads, dim, generator=g).to(device, dtype),
                k_cache=torch.randn(pool, kv_heads, dim, generator=g).to(device, dtype),
                v_cache=torch.randn(pool, kv_heads, dim, generator=g).to(device, dtype),
                req_to_token=req_to_token, rows=torch.arange(batch, device=device), seq_lens=lengths.to(device),
                sinks=torch.full((batch,), sinks, device=device), window=torch.full((batch,), window, device=device),
                scaling=dim ** -0.5)
    want, torch_s = timed(lambda: window_attention(**case, impl="torch"), device, repeats)
    checks = []
    for impl in ["triton"] + (["flashinfer"] if _flashinfer_takes(case["q"], case["k_cache"], case["v_cache"]) else []):
        got, impl_s = timed(lambda: window_attention(**case, impl=impl), device, repeats)
        checks.append({"case": f"window_attention_{impl}_{seq_len}", "tolerance": tolerance(dtype),
                       "max_abs_err": float((got.float() - want.float()).abs().max()), f"{impl}_s": impl_s,
                       "torch_reference_s": torch_s})
    return checks


def check_state_snapshot(device: torch.device, repeats: int, slots: int, rows: int, shapes: list[tuple[int, ...]],
                         dtype: torch.dtype) -> list[dict]:
    """GDN recurrent / conv state snapshot and restore (slot dim 1): must round-trip bit-exactly."""
    g = torch.Generator().manual_seed(7)
    states = [torch.randn(layers, slots, *rest, generator=g).to(device, dtype) for layers, *rest in shapes]
    chosen = (torch.randperm(slots - 1, generator=g)[:rows] + 1).to(device)
    want, torch_s = timed(lambda: snapshot_states(states, chosen, slot_dim=1, impl="torch"), device, repeats)
    checks = []
    for impl in ["triton"] + (["cupy"] if device.type == "cuda" and cupy_available() else []):
        got, impl_s = timed(lambda: snapshot_states(states, chosen, slot_dim=1, impl=impl), device, repeats)
        snap_err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
        scratch = [torch.zeros_like(s) for s in states]
        restore_states(scratch, chosen, got, slot_dim=1, impl=impl)
        back = [s.index_select(1, chosen) for s in scratch]
        restore_err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(back, want))
        checks.append({"case": f"state_snapshot_{impl}", "tolerance": 0.0, "max_abs_err": max(snap_err, restore_err),
                       "note": "snapshot and restore, bit-exact", f"{impl}_s": impl_s, "torch_reference_s": torch_s})
    return checks


class DevicePool:
    """A KV pool of plain tensors on one device (``ports.KVPool``), one request row: what the
    runtime's pure parts (recorder, compactor) are driven over without SGLang."""

    def __init__(self, layers: int, slots: int, kv_heads: int, dim: int, device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = [torch.randn(slots, kv_heads, dim, generator=g).to(device) for _ in range(layers)]
        self.values = [torch.randn(slots, kv_heads, dim, generator=g).to(device) for _ in range(layers)]
        self.slots = (torch.randperm(slots - 1, generator=g) + 1).to(device)
        self.num_layers, self.num_kv_heads, self.head_dim, self.device = layers, kv_heads, dim, device
        self.bytes_per_entry, self.can_fold, self.has_state, self.total = 2 * kv_heads * dim * 4, True, False, slots

    def layer_id(self, layer): return layer
    def read_keys(self, layer, slots): return self.keys[layer][slots]
    def read(self, layer, slots): return self.keys[layer][slots], self.values[layer][slots]
    def row(self, row, length): return self.slots[:length]

    def write(self, layer, slots, keys, values):
        self.keys[layer][slots], self.values[layer][slots] = keys, values


class OnePrefill:
    """A forward batch of one row prefilling ``length`` tokens from ``prefix_len`` (``ports.Batch``)."""

    is_extend, is_decode = True, False

    def __init__(self, prefix_len: int, length: int) -> None:
        from sglang_kvx.ports import Segment

        self.rows, self.segments = [0], [Segment(index=0, row=0, start=0, length=length, prefix_len=prefix_len)]


def policy_keep_sets(device: torch.device, n: int, layers: int, heads: int, kv_heads: int, dim: int,
                     gdn_layers: int, gdn_heads: int, chunk: int, keep_fraction: float) -> tuple[dict, float]:
    """Every served policy's keep-set for one random context, its signals recorded chunk by chunk by
    the server's recorder and compacted by the server's compactor, all on ``device``; and the
    seconds GateSight's scoring took there."""
    from sglang_kvx.compact.compactor import Compactor
    from sglang_kvx.gatesight.estimator import GateSightEstimator
    from sglang_kvx.gatesight.features import num_features
    from sglang_kvx.policies import get_policy, servable_policy_names
    from sglang_kvx.policies.gatesight import GateSightPolicy
    from sglang_kvx.policies.kvzip import accumulate_reconstruction_attention
    from sglang_kvx.settings import CompactionSettings
    from sglang_kvx.signals.recorder import SignalRecorder

    g = torch.Generator().manual_seed(11)
    features = num_features(gdn_heads)
    estimator = GateSightEstimator(
        torch.randn(layers, kv_heads, features, 64, generator=g) * 0.2, torch.randn(layers, kv_heads, 64, generator=g) * 0.1,
        torch.randn(layers, kv_heads, 64, generator=g) * 0.2, torch.zeros(layers, kv_heads),
        torch.zeros(layers, features), torch.ones(layers, features), manifest={"gdn_window": 6})
    queries = [torch.randn(n, heads * dim, generator=g).to(device) for _ in range(layers)]
    gates = [torch.randn(n, heads * dim, generator=g).to(device) for _ in range(layers)]
    gdn = [(torch.rand(n, gdn_heads, generator=g).to(device), -torch.rand(n, gdn_heads, generator=g).to(device),
            torch.randn(n, gdn_heads, 16, generator=g).to(device)) for _ in range(gdn_layers)]
    recon = [torch.randn(heads, 48, dim, generator=g).to(device) for _ in range(layers)]  # one reconstruction pass
    recon_keys = [torch.randn(48, kv_heads, dim, generator=g).to(device) for _ in range(layers)]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    pool = DevicePool(layers, 2 * n + 1, kv_heads, dim, device, seed=12)  # the context's slots, then the rank slots
    gdn_ids = list(range(gdn_layers))
    attention_ids = [gdn_layers + i for i in range(layers)]
    hidden = [torch.randn(n, heads * dim, generator=g).to(device) for _ in range(layers)]  # attention inputs (KVzap)
    plus_norms = [(torch.rand(heads, n, generator=g).to(device) + 0.5, torch.rand(48, generator=g).to(device) + 0.5)
                  for _ in range(layers)]  # KVzip+'s ||W_O^h v_i|| and ||h_j|| (random, positive)

    def kvzap(name: str):
        from sglang_kvx.policies.kvzap import KVzapSurrogate

        width, d = max(1, heads * dim // 8), heads * dim
        kind = "linear" if name == "kvzap_linear" else "mlp"
        layer = (lambda: {"weight": torch.randn(kv_heads, d, generator=g) / d ** 0.5, "bias": torch.zeros(kv_heads)}) \
            if kind == "linear" else (lambda: {"w1": torch.randn(width, d, generator=g) / d ** 0.5, "b1": torch.zeros(width),
                                                "w2": torch.randn(kv_heads, width, generator=g) / width ** 0.5, "b2": torch.zeros(kv_heads)})
        return get_policy(name)(surrogate=KVzapSurrogate(kind, [layer() for _ in range(layers)]), threshold=0.0, window=16)

    policies = {name: GateSightPolicy(estimator=estimator, impl="torch") if name == "gatesight" else
                kvzap(name) if name.startswith("kvzap") else get_policy(name)() for name in servable_policy_names()}
    compactor = Compactor(pool, policies.__getitem__, heads, attention_ids, gdn_ids, per_layer_lengths=True)
    recorder = SignalRecorder(pool, heads, lambda: inv_freq.to(device), gdn_ids, attention_ids)
    keeps, gatesight_s = {}, 0.0
    for name, policy in policies.items():
        spec = policy.captures()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()  # GateSight scores inside the prefill, chunk by chunk, as on one server rank
        recorder.start(0, n, spec, policy.chunk_scoring())
        for start in range(0, n, chunk):  # the prefill's chunks, as the adapter hands them over
            length = min(chunk, n - start)
            batch = OnePrefill(start, length)
            recorder.expect(batch)  # as the adapter does for each forward batch, before it runs
            for i, layer_id in enumerate(gdn_ids):
                beta, decay, v = (t[start : start + length] for t in gdn[i])
                recorder.gdn_signals(layer_id, 0, beta, decay, v)
            for layer in range(layers):
                recorder.attention_input(layer, hidden[layer][start : start + length], batch)
                recorder.attention(layer, queries[layer][start : start + length], batch, heads, dim, dim ** -0.5)
                recorder.output_gate(layer, gates[layer][start : start + length], batch, heads)
        recording = recorder.take(0)

        def fill(signals, recording=recording, name=name) -> None:
            if recording is not None:
                recording.fill(signals)
            if name in ("kvzip", "kvzip_plus"):
                signals.reconstruction_attention = []
                for layer in range(layers):
                    total = torch.zeros(kv_heads, n, device=device)
                    keys = torch.cat([pool.keys[layer][pool.slots[:n]], recon_keys[layer]])
                    plus = plus_norms[layer] if name == "kvzip_plus" else None
                    accumulate_reconstruction_attention(total, recon[layer], keys.transpose(0, 1), 0, n, plus=plus)
                    signals.reconstruction_attention.append(total)

        if device.type == "cuda":
            torch.cuda.synchronize()
        recording_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        context = compactor.compact(tuple(range(n)), pool.slots[:n].clone(),
                                    CompactionSettings(name, keep_fraction, 4, policy.allocation),
                                    take_slots=lambda count: pool.slots[n : n + count].clone(),  # the copy runs too
                                    fill_signals=fill, gdn_snapshot=None, timings={})
        if device.type == "cuda":
            torch.cuda.synchronize()
        if name == "gatesight":
            gatesight_s = recording_s + time.perf_counter() - t0
        keeps[name] = context.keep_positions
    return keeps, gatesight_s


def check_policies(device: torch.device, **shape) -> list[dict]:
    """Capture -> score -> allocate -> select of every served policy on ``device`` against the same
    on the CPU (the reference): the share of kept entries that differ (float ties only)."""
    want, _ = policy_keep_sets(torch.device("cpu"), **shape)
    got, gatesight_s = policy_keep_sets(device, **shape)
    checks = []
    for name in want:
        same = sum(len(set(a.tolist()) & set(b.tolist())) for la, lb in zip(got[name], want[name]) for a, b in zip(la, lb))
        total = sum(sum(h.numel() for h in b) for b in want[name])  # a layer: [kv_heads, K] or per-head tensors
        checks.append({"case": f"policy_{name}_{device.type}_{shape['n']}", "max_abs_err": round(1 - same / total, 6),
                       "tolerance": 0.01, "note": "share of kept entries that differ from the CPU run (float ties)",
                       **({"scoring_s": round(gatesight_s, 4)} if name == "gatesight" else {})})
    return checks


QWEN3_NEXT = dict(hidden=2048, heads=16, kv_heads=2, head_dim=256, key_heads=16, value_heads=32, gdn_dim=128,
                  mlp=5632, gdn_layers=36, attention_layers=12)  # Qwen3-Next-80B-A3B; mlp: 10 routed + 1 shared expert of 512


PREFILL_CHUNK = 8192  # SGLang's chunked-prefill size on GPUs


def gatesight_cost(device: torch.device, n: int, shape: dict, keep_fraction: float = 0.1, repeats: int = 3) -> dict:
    """GateSight's scoring (features, the estimators' MLP op, top-K per head) for one n-token context of
    a model of ``shape``, as one server rank runs it (chunk by chunk in 8K prefill chunks; also the
    whole context at once, as tensor-parallel ranks do after gathering the signals), against a lower bound on that context's prefill: every layer's projections,
    attention (SDPA, causal) and MLP at the real shape, timed one layer of each kind and counted
    over the stack (computed), with the GDN recurrence and the MoE routing left out, so the real
    prefill is longer and the true fraction smaller. Random weights, bf16 on CUDA (float32 on CPU)."""
    from sglang_kvx.gatesight.estimator import GateSightEstimator
    from sglang_kvx.gatesight.features import num_features
    from sglang_kvx.policies.gatesight import GateSightPolicy
    from sglang_kvx.select.keep_set import select_keep_set
    from sglang_kvx.signals import ContextSignals, GDNLayerSignals

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(21)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * cols ** -0.5).to(device, dtype)

    h, hd, vd = shape["hidden"], shape["head_dim"], shape["value_heads"] * shape["gdn_dim"]
    x = torch.randn(n, h, generator=g).to(device, dtype)
    mlp = (weight(2 * shape["mlp"], h), weight(h, shape["mlp"]))
    gdn_w = (weight(2 * shape["key_heads"] * shape["gdn_dim"] + 2 * vd, h), weight(2 * shape["value_heads"], h), weight(h, vd))
    attn_w = (weight(2 * shape["heads"] * hd + 2 * shape["kv_heads"] * hd, h), weight(h, shape["heads"] * hd))

    def mlp_part(y):
        gate, up = (y @ mlp[0].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ mlp[1].T

    def gdn_layer():
        y = x @ gdn_w[0].T
        x @ gdn_w[1].T
        return mlp_part(y[:, -vd:] @ gdn_w[2].T)

    def attention_layer():
        y = x @ attn_w[0].T
        q = y[:, : shape["heads"] * hd].reshape(n, shape["heads"], hd).transpose(0, 1)
        kv = y[:, 2 * shape["heads"] * hd :].reshape(n, 2, shape["kv_heads"], hd)
        k, v = (t.transpose(0, 1).repeat_interleave(shape["heads"] // shape["kv_heads"], dim=0) for t in kv.unbind(1))
        o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
        return mlp_part(o[0].transpose(0, 1).reshape(n, -1) @ attn_w[1].T)

    _, gdn_s = timed(gdn_layer, device, repeats)
    _, attention_s = timed(attention_layer, device, repeats)
    if gdn_s is None:  # CPU: one timed run each
        gdn_s, attention_s = (min(_wall(fn) for _ in range(max(1, repeats))) for fn in (gdn_layer, attention_layer))
    prefill_s = gdn_s * shape["gdn_layers"] + attention_s * shape["attention_layers"]

    layers, features = shape["attention_layers"], num_features(shape["value_heads"])
    estimator = GateSightEstimator(
        torch.randn(layers, shape["kv_heads"], features, 64, generator=g) * 0.1, torch.zeros(layers, shape["kv_heads"], 64),
        torch.randn(layers, shape["kv_heads"], 64, generator=g) * 0.1, torch.zeros(layers, shape["kv_heads"]),
        torch.zeros(layers, features), torch.ones(layers, features), manifest={"gdn_window": 6})
    per = shape["gdn_layers"] // layers  # GDN layers before each attention layer (3:1 in Qwen3-Next)
    signals = ContextSignals(
        n=n, num_q_heads=shape["heads"], num_kv_heads=shape["kv_heads"], head_dim=hd,
        keys=[torch.empty(0)] * layers, values=[torch.empty(0)] * layers,  # GateSight reads no keys
        gdn=[GDNLayerSignals(torch.rand(n, shape["value_heads"], generator=g).to(device),
                             -torch.rand(n, shape["value_heads"], generator=g).to(device),
                             torch.rand(n, shape["value_heads"], generator=g).to(device) + 0.1)
             for _ in range(shape["gdn_layers"])],
        gdn_layer_of_attention=[per * (i + 1) for i in range(layers)], device=device)
    policy = GateSightPolicy(estimator=estimator)
    budget = int(keep_fraction * n)

    def score_and_select():  # the whole context at once: a tensor-parallel rank, after the gather
        return select_keep_set(policy.score_layers(signals), [budget] * layers, 0)

    def score_in_chunks_and_select():  # one rank: each 8K prefill chunk scored as it runs (the recorder)
        scores = [[] for _ in range(layers)]
        for start in range(0, n, PREFILL_CHUNK):
            positions = range(start, min(n, start + PREFILL_CHUNK))
            for layer in range(layers):
                before = signals.gdn_layer_of_attention[layer]
                gdn = [GDNLayerSignals(*(t[positions.start : positions.stop] for t in (s.beta, s.g, s.v_norm)))
                       for s in signals.gdn[max(0, before - policy.window) : before]]
                scores[layer].append(policy.score_chunk(layer, gdn, positions, n))
        return select_keep_set([torch.cat(chunks, dim=-1) for chunks in scores], [budget] * layers, 0)

    costs = []
    for fn in (score_in_chunks_and_select, score_and_select):
        _, cost = timed(fn, device, repeats)
        costs.append(cost if cost is not None else min(_wall(fn) for _ in range(max(1, repeats))))
    scoring_s, whole_s = costs
    return {"case": f"gatesight_cost_{n}", "context_tokens": n, "scoring_s": round(scoring_s, 5),
            "scoring_whole_context_s": round(whole_s, 5),
            "prefill_lower_bound_s_computed": round(prefill_s, 5), "gdn_layer_s": round(gdn_s, 5),
            "attention_layer_s": round(attention_s, 5),
            "scoring_frac_of_prefill_upper_bound": round(scoring_s / prefill_s, 5)}


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check_warm_up(device: torch.device, smoke: bool) -> list[dict]:
    """The server's start-up check of every op (``sglang_kvx/ops/warmup.py``): each chosen kernel against its
    reference on tiny shapes (under ``--smoke`` every op's Triton kernel, in the interpreter)."""
    import os

    from sglang_kvx.ops import dispatch
    from sglang_kvx.ops.warmup import every_op, warm_up

    previous = os.environ.get(dispatch.ENV)
    if smoke:
        os.environ[dispatch.ENV] = "triton"  # on CPU auto is the reference: warm the Triton kernels instead
        dispatch._parse.cache_clear()
    try:
        report = warm_up(every_op(), device)
    finally:
        if smoke:
            os.environ.pop(dispatch.ENV) if previous is None else os.environ.__setitem__(dispatch.ENV, previous)
            dispatch._parse.cache_clear()
    return [{"case": f"warm_up {entry['op']} ({entry['impl']})", "max_abs_err": entry.get("max_abs_err", float("inf")),
             "tolerance": entry.get("tolerance", 0.0), "seconds": entry.get("seconds"),
             **({"error": entry["error"]} if "error" in entry else {})} for entry in report]


def check_syncs_and_graphs(device: torch.device) -> list[dict]:
    """Per op, on CUDA: the host syncs one call of its chosen kernel makes (``torch.cuda.set_sync_debug_mode``),
    and whether it captures into a ``torch.cuda.graph`` and replays the eager result. No op runs on a graph
    path today (graph eligibility keeps every batch that needs one eager); capture is reported, a replay
    that differs from the eager call fails."""
    import warnings

    from sglang_kvx.ops.dispatch import choose
    from sglang_kvx.ops.warmup import CASES

    checks = []
    for op, make in CASES.items():
        case, tolerance = make(device)
        impl = choose(op, None, device)
        entry = {"case": f"syncs_and_graph {op} ({impl})", "tolerance": tolerance, "on_graph_path": False}
        want = case(impl)  # compiled and planned before counting
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                case(impl)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        entry["host_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                case(impl)  # warm on the side stream, as SGLang's capture does
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                out = case(impl)
            graph.replay()
            torch.cuda.synchronize()
            entry["captured"] = True
            entry["max_abs_err"] = float((torch.as_tensor(out).float() - torch.as_tensor(want).float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - an op that cannot be captured is reported, not failed
            entry.update(captured=False, capture_error=f"{type(exc).__name__}: {str(exc)[:160]}", max_abs_err=0.0)
        checks.append(entry)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (set TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per check on CUDA (default: 10)")
    parser.add_argument("--plant", action="store_true", help="check a planted wrong kernel too (the script must then exit 1)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --smoke and TRITON_INTERPRET=1 on a CPU")
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
                    "torch": torch.__version__, "checks": []}
    if args.smoke:
        shapes = [("decode", dict(batch=3, seq_len=40, q_len=1, prefix=20, hidden=6, extras=5, heads=4, kv_heads=2,
                                  dim=16, dtype=torch.float32, seed=1))]
        result["checks"].append(check_mlp_utility(device, 0, n=70))
        if args.plant:
            result["checks"].append(check_mlp_utility(device, 0, n=70, plant=True))
    else:
        # A folded 4K context at p = 0.1 (410 slots): a layer hiding 195 ranks or borrowing 195 entries;
        # 64 children decoding, and 4 children prefilling a 64-token question.
        common = dict(prefix=410, heads=32, kv_heads=8, dim=128, seed=1)
        shapes = [
            ("decode_bf16_hidden", dict(batch=64, seq_len=1024, q_len=1, hidden=195, extras=0, dtype=torch.bfloat16, **common)),
            ("decode_bf16_borrowed", dict(batch=64, seq_len=1024, q_len=1, hidden=0, extras=195, dtype=torch.bfloat16, **common)),
            ("decode_fp32_borrowed", dict(batch=16, seq_len=1024, q_len=1, hidden=0, extras=195, dtype=torch.float32, **common)),
            ("extend_bf16_question", dict(batch=4, seq_len=474, q_len=64, hidden=195, extras=0, dtype=torch.bfloat16, **common)),
        ]
        for n in (4096, 16384):
            result["checks"].append(check_mlp_utility(device, args.repeats, n=n))
        if args.plant:
            result["checks"].append(check_mlp_utility(device, args.repeats, n=4096, plant=True))
    for name, shape in shapes:
        result["checks"].append(check_prefix_attention(name, device, 0 if args.smoke else args.repeats, **shape))
    size = dict(batch=2, seq_len=30, heads=2, dim=16, folded_len=8) if args.smoke else \
        dict(batch=32, seq_len=2048, heads=12, dim=64, folded_len=512)
    for kind in ("sigmoid", "softmax"):
        result["checks"].append(check_gated_attention(f"gated_{kind}_decode_folded", device,
                                                      0 if args.smoke else args.repeats, kind, **size))
    sparse = dict(n=70, queries=3, heads=4, kv_heads=2, dim=16, budget_blocks=4, dtype=torch.float32) if args.smoke else \
        dict(n=16384, queries=64, heads=32, kv_heads=8, dim=128, budget_blocks=512, dtype=torch.bfloat16)
    result["checks"].extend(check_block_sparse(device, 0 if args.smoke else args.repeats, **sparse))
    window = dict(batch=3, seq_len=40, heads=4, kv_heads=2, dim=16, sinks=2, window=8, dtype=torch.float32) if args.smoke else \
        dict(batch=32, seq_len=16384, heads=32, kv_heads=8, dim=128, sinks=4, window=256, dtype=torch.bfloat16)
    result["checks"].extend(check_window_attention(device, 0 if args.smoke else args.repeats, **window))
    # Qwen3-Next-like per layer: conv state [slots, conv channels, kernel - 1], recurrent [slots, heads, Dk, Dv].
    snapshot = dict(slots=9, rows=3, shapes=[(2, 12, 3), (2, 2, 8, 8)], dtype=torch.float32) if args.smoke else \
        dict(slots=128, rows=32, shapes=[(36, 8192, 3), (36, 32, 128, 128)], dtype=torch.float32)  # ~10 GB of states
    result["checks"].extend(check_state_snapshot(device, 0 if args.smoke else args.repeats, **snapshot))
    if not args.smoke:  # bf16 pools: SGLang's KV and state dtype on a GPU
        result["checks"].extend(check_state_snapshot(device, args.repeats, **{**snapshot, "dtype": torch.bfloat16}))
        result["checks"].extend(check_window_attention(device, args.repeats, **{**window, "seq_len": 4096}))
        result["checks"].extend(check_syncs_and_graphs(device))
    result["checks"].extend(check_warm_up(device, args.smoke))
    # The runtime's capture and compaction paths of every policy, on the device's tensors.
    policies = dict(n=96, layers=2, heads=4, kv_heads=2, dim=16, gdn_layers=3, gdn_heads=4, chunk=40, keep_fraction=0.25) \
        if args.smoke else dict(n=8192, layers=4, heads=16, kv_heads=2, dim=128, gdn_layers=12, gdn_heads=32, chunk=2048,
                                 keep_fraction=0.1)
    result["checks"].extend(check_policies(device, **policies))
    # GateSight's scoring against a prefill lower bound at a Qwen3-Next layer shape (the seed: 1.0-1.4%).
    tiny = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, key_heads=2, value_heads=4, gdn_dim=8, mlp=128,
                gdn_layers=6, attention_layers=2)
    result["gatesight_cost"] = [gatesight_cost(device, n, tiny if args.smoke else QWEN3_NEXT, repeats=1 if args.smoke else 3)
                                for n in ((256,) if args.smoke else (32768, 65536, 131072))]
    failed = [c["case"] for c in result["checks"] if not c["max_abs_err"] <= c["tolerance"]]
    for check in result["checks"]:  # one JSON line per op check, then one for the rest and the verdict
        print(json.dumps({**check, "failed": check["case"] in failed}))
    print(json.dumps({"device": result["device"], "torch": result["torch"], "gatesight_cost": result["gatesight_cost"],
                      "checks": len(result["checks"]), "failed": failed, "passed": not failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
