"""Snapshot and restore of GDN recurrent and conv states for a set of pool slots (ops/state_snapshot.py).

Round trips are checked bit for bit (random bits, NaN payloads included) after the states are
overwritten, in SGLang's MambaPool layout (slot dim 1) and a layer's view (slot dim 0); only
the given slots may change. The Triton kernel runs under TRITON_INTERPRET=1; the CuPy kernel
whenever cupy imports with a CUDA device.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_kvx.ops.gdn import causal_conv1d_step, gated_delta_rule_step
from sglang_kvx.ops.state_snapshot import restore_states, snapshot_states

from interpreter import interpreted_lines


def pool_states(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """MambaPool-shaped states: temporal [L, S, H, V, K] float32, two conv states [L, S, C, K-1]
    in bf16 and fp16, filled with random bits (so NaNs and -0.0 are in play)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((3, 11, 2, 4, 6), torch.float32), ((3, 11, 10, 3), torch.bfloat16), ((3, 11, 5, 3), torch.float16)]
    states = []
    for shape, dtype in shapes:
        bits = torch.randint(-(2**15), 2**15, shape + (dtype.itemsize // 2,), generator=g, dtype=torch.int16)
        states.append(bits.view(dtype).reshape(shape).to(device))
    return states


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def round_trip(impl: str, device: str = "cpu") -> dict:
    """Snapshot slots, overwrite every state, restore: the slots get their bits back, nothing else changes."""
    checks = {}
    slots = torch.tensor([9, 0, 4, 10])
    # Pool layout (slot dim 1), one layer's view of it (slot dim 0), and slot-major memory
    # (strides out of shape order, as in SGLang's envelope layout).
    slot_major = lambda s: s.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731
    for name, dim, pick in [("pool", 1, lambda s: s), ("layer", 0, lambda s: s[1]), ("slot_major", 1, slot_major)]:
        states = [pick(s) for s in pool_states(1, device)]
        before = [s.clone() for s in states]
        snap = snapshot_states(states, slots, slot_dim=dim, impl=impl)
        checks[f"{name}_snapshot_exact"] = all(
            same_bits(x, b.index_select(dim, slots.to(device))) for x, b in zip(snap, before))
        checks[f"{name}_snapshot_reads_only"] = all(same_bits(s, b) for s, b in zip(states, before))
        overwritten = [pick(s) for s in pool_states(2, device)]
        for s, o in zip(states, overwritten):
            s.copy_(o)
        restore_states(states, slots, snap, slot_dim=dim, impl=impl)
        want = [o.index_copy(dim, slots.to(device), b.index_select(dim, slots.to(device)))
                for o, b in zip(overwritten, before)]
        checks[f"{name}_restore_exact_and_only_slots"] = all(same_bits(s, w) for s, w in zip(states, want))
    # One slot dim per state, and an empty slot set.
    states = pool_states(3, device)
    mixed = [states[0], states[1][0], states[2]]
    snap = snapshot_states(mixed, slots, slot_dim=[1, 0, -3], impl=impl)
    checks["per_state_dims"] = same_bits(snap[0], states[0][:, slots]) and same_bits(snap[1], states[1][0, slots]) \
        and same_bits(snap[2], states[2][:, slots])
    empty = snapshot_states(states, slots[:0], slot_dim=1, impl=impl)
    restore_states(states, slots[:0], empty, slot_dim=1, impl=impl)
    checks["empty_slots"] = [tuple(e.shape) for e in empty] == [(3, 0, 2, 4, 6), (3, 0, 10, 3), (3, 0, 5, 3)]
    return checks


def test_round_trip_is_bit_exact_with_the_reference() -> None:
    checks = round_trip("torch")
    assert all(checks.values()), checks


def test_auto_on_cpu_and_states_that_do_not_flatten() -> None:
    """A transposed state or one with padded trailing dims has no [outer, S, inner] view; it still round-trips."""
    g = torch.Generator().manual_seed(4)
    padded = torch.randn(4, 7, 6, 8, generator=g)[..., :5]  # trailing dims not contiguous
    transposed = torch.randn(6, 7, 4, generator=g).transpose(0, 2)  # slot dim 1, strides out of order
    slots = torch.tensor([6, 1])
    before = [padded.clone(), transposed.clone()]
    snap = snapshot_states([padded, transposed], slots, slot_dim=1)
    padded.zero_()
    transposed.zero_()
    restore_states([padded, transposed], slots, snap, slot_dim=1)
    for state, b in zip((padded, transposed), before):
        assert torch.equal(state[:, slots], b[:, slots]) and not state[:, 0].any()


def test_a_full_retry_after_a_local_attempt_equals_a_full_only_step() -> None:
    """The ODA use: a GDN decode step commits into the pool; restoring the snapshot undoes it exactly."""
    g = torch.Generator().manual_seed(5)
    temporal = torch.randn(2, 6, 2, 8, 4, generator=g)  # [L, S, Hv, Dk, Dv]
    conv = torch.randn(2, 6, 12, 3, generator=g)  # [L, S, C, K-1]
    slots = torch.tensor([3, 1])
    q, k, v = torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 4, generator=g)
    gate, beta, x = -torch.rand(2, 2, generator=g), torch.rand(2, 2, generator=g), torch.randn(2, 12, generator=g)
    weight = torch.randn(12, 4, generator=g)

    def step(query):  # one decode step of layer 0 for the two rows, committed into the pool
        o, new = gated_delta_rule_step(query, k, v, gate, beta, temporal[0, slots])
        y, new_conv = causal_conv1d_step(x, conv[0, slots], weight, None)
        temporal[0, slots], conv[0, slots] = new, new_conv
        return o, y

    snap = snapshot_states([temporal, conv], slots, slot_dim=1)
    full_only = step(q)
    after_full_only = [temporal.clone(), conv.clone()]
    restore_states([temporal, conv], slots, snap, slot_dim=1)
    step(q * 0.5)  # the Local attempt: another query, the same state
    restore_states([temporal, conv], slots, snap, slot_dim=1)
    retry = step(q)
    assert all(torch.equal(a, b) for a, b in zip(retry, full_only))
    assert torch.equal(temporal, after_full_only[0]) and torch.equal(conv, after_full_only[1])


def test_triton_kernel_round_trips_under_the_interpreter() -> None:
    code = (
        "import json, sys; sys.path.insert(0, 'tests')\n"
        "import sglang_kvx.ops.triton_state_snapshot as kernel\n"
        "from test_ops_state_snapshot import round_trip\n"
        "launches = []\n"
        "copy = kernel.copy_rows_triton\n"
        "kernel.copy_rows_triton = lambda *a, **k: (launches.append(1), copy(*a, **k))\n"
        "checks = round_trip('triton')\n"
        "print(json.dumps({**checks, 'launches': len(launches)}))\n"
    )
    lines = interpreted_lines(code)
    checks = json.loads(lines[-1])
    # Every non-empty copy went through the kernel: 3 layouts x 3 states x (snapshot + restore), + 3.
    assert checks.pop("launches") == 21, checks
    assert len(checks) == 11 and all(checks.values()), checks


@pytest.mark.gpu
def test_cupy_kernel_round_trips() -> None:
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy does not import (it is the optional 'gpu' extra)")
    try:
        has_device = cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available()
    except Exception:
        has_device = False
    if not has_device:
        pytest.skip("cupy imports but there is no CUDA device to run its kernel on")
    checks = round_trip("cupy", "cuda")
    assert all(checks.values()), checks
    # auto picks CuPy on CUDA; the Triton kernel agrees there too.
    assert all(round_trip("auto", "cuda").values()) and all(round_trip("triton", "cuda").values())


def test_bad_inputs_and_missing_backends_are_refused(monkeypatch) -> None:
    states = pool_states(0)
    with pytest.raises(ValueError, match=r"\[0, 11\)"):
        snapshot_states(states, torch.tensor([11]), slot_dim=1)
    with pytest.raises(ValueError, match="out of range"):
        snapshot_states(states, torch.tensor([1]), slot_dim=5)
    with pytest.raises(ValueError, match="slot dims"):
        snapshot_states(states, torch.tensor([1]), slot_dim=[1, 1])
    snap = snapshot_states(states, torch.tensor([1, 2]), slot_dim=1)
    with pytest.raises(ValueError, match="does not fit"):
        restore_states(states, torch.tensor([1]), snap, slot_dim=1)
    with pytest.raises(ValueError, match="impl"):
        snapshot_states(states, torch.tensor([1]), slot_dim=1, impl="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        snapshot_states(states, torch.tensor([1]), slot_dim=1, impl="triton")
    with pytest.raises(RuntimeError, match="cupy"):
        snapshot_states(states, torch.tensor([1]), slot_dim=1, impl="cupy")


def test_slots_checked_by_the_device_refuse_a_bad_slot_and_read_nothing_back() -> None:
    from sglang_kvx.ops.host_syncs import HostSyncCounter

    states, slots = pool_states(0), torch.tensor([3, 7])
    with HostSyncCounter() as counter:
        snap = snapshot_states(states, slots, slot_dim=1, bounds="device")
    assert counter.total == 0, counter.counts
    assert all(same_bits(s, state.index_select(1, slots)) for s, state in zip(snap, states))  # NaNs in play
    for bad in ([11], [-1], [2, 11]):  # on CPU the device's assertion raises at once
        with pytest.raises(RuntimeError, match=r"slots must lie in \[0, 11\)"):
            snapshot_states(states, torch.tensor(bad), slot_dim=1, bounds="device")
    with pytest.raises(ValueError, match="bounds"):
        snapshot_states(states, torch.tensor([1]), slot_dim=1, bounds="none")
