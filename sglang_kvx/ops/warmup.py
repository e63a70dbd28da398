"""Each kernel a server will run, compiled and checked once at start, on tiny shapes.

Triton compiles a kernel on its first call and FlashInfer plans on its first; without a warm-up that
happens inside the first request that needs it (seconds, inside a forward), and a kernel that cannot
run on this machine fails there. ``warm_up(ops, device)`` runs, for every op whose chosen implementation
(``ops/dispatch.py``) is not the torch reference, one tiny call of the kernel and of the reference and
compares them; a kernel that raises or disagrees is replaced by the reference for the process
(``dispatch.fall_back``: logged once, in ``/kvx/stats``). On CPU every op runs its reference and there is
nothing to warm up. ``perf/gpu_check.py`` runs the same warm-up on a lent GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from sglang_kvx.ops.dispatch import OPS, choose, fall_back, fallbacks

logger = logging.getLogger(__name__)

Case = Callable[[str], object]  # impl -> the op's output for one tiny call


def _window(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.window_attention import window_attention

    g = torch.Generator().manual_seed(0)
    batch, seq, heads, kv, dim = 2, 24, 4, 2, 16
    pool = batch * seq + 1
    r2t = (torch.randperm(pool - 1, generator=g)[: batch * seq] + 1).view(batch, seq).to(torch.int32).to(device)
    args = dict(q=torch.randn(batch, heads, dim, generator=g).to(device),
                k_cache=torch.randn(pool, kv, dim, generator=g).to(device),
                v_cache=torch.randn(pool, kv, dim, generator=g).to(device), req_to_token=r2t,
                rows=torch.arange(batch, device=device), seq_lens=torch.tensor([seq, seq - 5], device=device),
                sinks=torch.full((batch,), 2, device=device), window=torch.full((batch,), 8, device=device),
                scaling=dim ** -0.5)
    return (lambda impl: window_attention(**args, impl=impl)), 1e-4


def _prefix(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.prefix_attention import prefix_cells_attention

    g = torch.Generator().manual_seed(1)
    batch, seq, q_len, heads, kv, dim, extras = 2, 20, 3, 4, 2, 16, 3
    pool = batch * seq + 1
    r2t = (torch.randperm(pool - 1, generator=g)[: batch * seq] + 1).view(batch, seq).to(torch.int32).to(device)
    args = dict(q=torch.randn(batch * q_len, heads, dim, generator=g).to(device),
                k_cache=torch.randn(pool, kv, dim, generator=g).to(device),
                v_cache=torch.randn(pool, kv, dim, generator=g).to(device), req_to_token=r2t,
                rows=torch.arange(batch, device=device), seq_lens=torch.full((batch,), seq, device=device),
                q_lens=torch.full((batch,), q_len, device=device), hidden_from=torch.full((batch,), 4, device=device),
                hidden_to=torch.full((batch,), 9, device=device),
                extra_k=torch.randn(batch * extras, kv, dim, generator=g).to(device),
                extra_v=torch.randn(batch * extras, kv, dim, generator=g).to(device),
                extra_indptr=(torch.arange(batch + 1) * extras).to(device), scaling=dim ** -0.5)
    return (lambda impl: prefix_cells_attention(**args, impl=impl)), 1e-4


def _gated(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.gated_attention import gated_attention

    g = torch.Generator().manual_seed(2)
    batch, seq, heads, dim = 2, 16, 2, 16
    pool = batch * seq + 1
    r2t = (torch.randperm(pool - 1, generator=g)[: batch * seq] + 1).view(batch, seq).to(torch.int32).to(device)
    args = dict(q=torch.randn(batch, heads, dim, generator=g).to(device),
                k_cache=torch.randn(pool, heads, dim, generator=g).to(device),
                v_cache=torch.randn(pool, heads, dim, generator=g).to(device),
                key_gate=torch.rand(pool, generator=g).to(device), req_to_token=r2t, rows=torch.arange(batch, device=device),
                seq_lens=torch.full((batch,), seq, device=device), q_lens=torch.ones(batch, dtype=torch.long, device=device),
                q_positions=torch.full((batch,), seq - 1, device=device), tau=torch.full((batch,), 0.1, device=device),
                kind="sigmoid", scaling=dim ** -0.5)
    return (lambda impl: gated_attention(**args, impl=impl)), 1e-4


def _gatesight(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.gatesight import mlp_utility

    g = torch.Generator().manual_seed(3)
    layers, heads, n, features, units = 2, 2, 8, 12, 16
    args = (torch.randn(layers, n, features, generator=g).to(device),
            (torch.randn(layers, heads, features, units, generator=g) / 4).to(device),
            torch.randn(layers, heads, units, generator=g).to(device), torch.randn(layers, heads, units, generator=g).to(device),
            torch.randn(layers, heads, generator=g).to(device))
    return (lambda impl: mlp_utility(*args, impl=impl)), 1e-4


def _snapshot(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.state_snapshot import restore_states, snapshot_states

    g = torch.Generator().manual_seed(4)
    states = [torch.randn(2, 9, 3, 4, generator=g).to(device), torch.randn(2, 9, 5, generator=g).to(device)]
    slots = torch.tensor([3, 7], device=device)

    def case(impl: str) -> torch.Tensor:
        saved = snapshot_states(states, slots, slot_dim=1, impl=impl)
        scratch = [torch.zeros_like(s) for s in states]
        restore_states(scratch, slots, saved, slot_dim=1, impl=impl)
        return torch.cat([s.flatten() for s in saved + scratch])

    return case, 0.0  # a copy: bit-exact


def _block_compress(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.block_sparse import compress_blocks, row_blocks

    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(40, generator=g)[:30] + 1
    block_slots, _ = row_blocks(slots)
    k_cache = torch.randn(41, 2, 16, generator=g).to(device)
    return (lambda impl: compress_blocks(k_cache, block_slots.to(device), impl=impl)), 1e-4


def _block_select(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.block_sparse import select_blocks

    g = torch.Generator().manual_seed(6)
    queries, heads, kv, dim, blocks = 4, 4, 2, 16, 12
    q, keys = torch.randn(queries, heads, dim, generator=g).to(device), torch.randn(blocks, kv, dim, generator=g).to(device)
    lo = torch.zeros(queries, dtype=torch.long, device=device)
    hi = torch.tensor([6, 8, 10, 12], device=device)
    return (lambda impl: select_blocks(q, keys, lo, hi, 4, 1, dim ** -0.5, impl=impl).float()), 0.0


def _block_attention(device: torch.device) -> tuple[Case, float]:
    from sglang_kvx.ops.block_sparse import block_sparse_attention, row_blocks, select_blocks

    g = torch.Generator().manual_seed(7)
    n, queries, heads, kv, dim = 32, 4, 4, 2, 16
    slots = torch.randperm(n + 8, generator=g)[:n] + 1
    block_slots, block_positions = (t.to(device) for t in row_blocks(slots))
    k_cache, v_cache = (torch.randn(n + 9, kv, dim, generator=g).to(device) for _ in range(2))
    q = torch.randn(queries, heads, dim, generator=g).to(device)
    q_positions = torch.arange(n - queries, n, device=device)
    keys = k_cache[block_slots.clamp(min=0)].mean(1)
    selected = select_blocks(q, keys, torch.zeros(queries, dtype=torch.long, device=device), q_positions // 4 + 1, 4, 1,
                             dim ** -0.5, impl="torch")
    args = (q, k_cache, v_cache, block_slots, block_positions, selected, q_positions, dim ** -0.5)
    return (lambda impl: block_sparse_attention(*args, impl=impl)), 1e-4


CASES: dict[str, Callable[[torch.device], tuple[Case, float]]] = {
    "window_attention": _window, "prefix_attention": _prefix, "gated_attention": _gated, "gatesight_utility": _gatesight,
    "state_snapshot": _snapshot, "block_compress": _block_compress, "block_select": _block_select,
    "block_sparse_attention": _block_attention,
}


def _difference(got: object, want: object) -> float:
    return float((torch.as_tensor(got).float() - torch.as_tensor(want).float()).abs().max())


def warm_up(ops: Iterable[str], device: torch.device) -> list[dict]:
    """Compile and check each op of ``ops`` whose chosen implementation on ``device`` is not the reference;
    one that raises or disagrees falls back to the reference. What each check found, one dict per op."""
    report = []
    for op in ops:
        try:
            chosen = choose(op, None, device)
        except (RuntimeError, ValueError) as exc:  # an implementation asked for by name that cannot run here
            fall_back(op, "asked", exc, "warm-up")
            report.append({"op": op, "impl": "asked", "ok": False, "error": str(exc)})
            continue
        if chosen == "torch" or op in fallbacks():
            continue
        t0 = time.perf_counter()
        entry = {"op": op, "impl": chosen}
        try:
            case, tolerance = CASES[op](device)
            entry["tolerance"] = tolerance
            got, want = case(chosen), case("torch")
            entry["max_abs_err"] = err = _difference(got, want)
            entry["ok"] = err <= tolerance
            if not entry["ok"]:
                fall_back(op, chosen, f"differs from the torch reference by {err:.3g} on the warm-up's shapes "
                                      f"(tolerance {tolerance:g})", "warm-up")
        except Exception as exc:  # noqa: BLE001 - reported, and the reference serves the op
            entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            fall_back(op, chosen, exc, "warm-up")
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        report.append(entry)
        logger.info("sglang_kvx: op %s (%s) warmed up in %.2f s: %s", op, chosen, entry["seconds"],
                    "ok" if entry["ok"] else "failed, the torch reference serves it")
    return report


def every_op() -> list[str]:
    return list(OPS)
