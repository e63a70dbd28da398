"""The host-memory tier (issue #44 item 1) on the plain pool views the compactor's tests use: an
evicted context moves to host memory and comes back into fresh slots byte for byte, its folded or
per-head cells re-pointed; the tier is bounded, least recently used first and fair over tenants; a
pool that cannot take a context back leaves the child to a full prefill; nothing leaks."""

from __future__ import annotations

import torch

from sglang_kvx.compact.compactor import Compactor
from sglang_kvx.compact.layout import fold_heads, fold_layers
from sglang_kvx.serve.admission import Admission
from sglang_kvx.serve.plans import CHILD, PLAIN, RESTORE, WAIT, WAIT_READ, WAIT_ROOM, Plan
from sglang_kvx.settings import CompactionSettings, ServerDefaults
from sglang_kvx.store import CompactedContext, ContextStore
from sglang_kvx.store.tiers import HostTier, TieredContext
from test_compactor_views import TensorPool

SETTINGS = CompactionSettings("knorm", 0.5, 0, "flat")
KVX = {"kvx": {"policy": "knorm", "keep_fraction": 0.5, "protected_prefix_len": 0, "allocation": "flat"}}


class Child:
    """A request as admission sees it (``ports.Request``), before it holds KV."""

    def __init__(self, input_ids: list[int], max_new_tokens: int = 2) -> None:
        self.rid, self.input_ids, self.custom_params = "child", list(input_ids), KVX
        self.max_new_tokens, self.has_output, self.finished, self.aborted, self.holds_kv = max_new_tokens, False, False, False, False
        self.input_logprobs_from, self.state, self.error, self.out_of_tree = None, None, None, False
        self.namespace = None  # no extra_key or cache_salt

    def abort(self, message: str, status: int = 400) -> None:
        self.error, self.status = message, status

    def keep_out_of_tree(self) -> None:
        self.out_of_tree = True

    def replace_input_ids(self, ids) -> None:
        self.input_ids = list(ids)


class Budget:
    """SGLang's round budget as admission sees it (``ports.RoundBudget``): the pool's room less what the
    requests admitted before this one in the round reserve."""

    def __init__(self, pool: TensorPool, reserved: int = 0) -> None:
        self.pool, self.reserved = pool, reserved

    def room(self) -> int:
        return self.pool.room() - self.reserved


def admit(admission: Admission, request: Child, budget: Budget | None = None) -> Plan:
    """One prefill round as SGLang runs it with the adapter's hooks: the plan where the prefix is matched;
    for RESTORE, the restore where the round's budget is charged, then the match again. A disk read is
    waited for (the tier's worker), as the queued child waits for it over the next rounds."""
    for _ in range(100):
        plan = admission.before_round(request)
        if plan.kind == RESTORE:
            admission.admit_restore(request, budget or Budget(admission.pool))
            if request.state.plan is None:
                plan = admission.before_round(request)
            else:
                plan = request.state.plan
        if plan.kind == WAIT and plan.reason == WAIT_READ:
            admission.tiering.disk.drain()
            continue
        return plan
    raise AssertionError("a disk read never finished")


def server(pool: TensorPool, host_gb: float = 1.0) -> Admission:
    return Admission(pool, ContextStore(), ServerDefaults("knorm", 0.5, 0, frozenset({"keys"}), min_store_fraction=0.0,
                                                          host_store_gb=host_gb), num_rows=4)


def stored_context(pool: TensorPool, admission: Admission, ids: tuple[int, ...], layout, kept, tenant=None,
                   snapshot=None) -> CompactedContext:
    """A context in the pool with distinct random entries in every cell of its S slots."""
    slots = pool.alloc(layout.num_slots)
    for layer in range(pool.num_layers):
        pool.write(layer, slots, torch.randn(len(slots), pool.num_kv_heads, pool.head_dim),
                   torch.randn(len(slots), pool.num_kv_heads, pool.head_dim))
    compactor = Compactor(pool, lambda name: None, num_q_heads=2, attention_layer_ids=[10, 11, 12],
                          gdn_layer_ids=[], per_layer_lengths=True)
    context = CompactedContext(context_ids=ids, settings=SETTINGS, slots=slots, kept_per_layer=kept, layout=layout,
                               prefix_cells=compactor.prefix_cells(slots, layout), tenant=tenant, gdn_snapshot=snapshot)
    admission.store.add(context)
    return context


def scribble(pool: TensorPool) -> None:
    """Every cell of the pool overwritten: a restore must bring the bytes back, not find them still there."""
    for layer in range(pool.num_layers):
        pool.keys[layer].normal_()
        pool.values[layer].normal_()


def check_round_trip(layout, kept) -> None:
    snapshot = torch.arange(6.0)
    pool = TensorPool(slots=40, state=torch.zeros(6))  # a hybrid model's pool: one state slot's snapshot is 6 floats
    whole = pool.room()
    admission = server(pool)
    ids = tuple(range(100, 112))
    context = stored_context(pool, admission, ids, layout, kept, snapshot=snapshot)
    images = [tuple(t.clone() for t in pool.read(layer, context.slots)) for layer in range(pool.num_layers)]
    assert admission.eviction.make_room(pool.room() + 2) is None  # a request needing more: the store gives way
    tiering = admission.eviction.tiering
    assert len(admission.store) == 0 and len(tiering.host) == 1 and admission.eviction.evicted == 1
    assert tiering.host.nbytes == 2 * pool.num_layers * layout.num_slots * pool.bytes_per_entry // 2 + snapshot.numel() * 4
    scribble(pool)
    pool.alloc(3)  # the freed slots are not where they were: the restore takes fresh ones
    child = Child(list(ids) + [7, 8, 9])
    assert admit(admission, child).kind == CHILD and child.error is None
    restored = child.state.context
    assert child.state.outcome["restored_from"] == "host" and child.state.outcome["restore_s"] >= 0
    assert restored is admission.store.get(ids, SETTINGS) and len(tiering.host) == 0
    assert not torch.equal(restored.slots, context.slots)
    assert restored.gdn_snapshot is snapshot and restored.kept_per_layer == kept and restored.layout == layout
    for layer in range(pool.num_layers):  # every cell of the S slots: own ranks and lent ones
        keys, values = pool.read(layer, restored.slots)
        assert torch.equal(keys, images[layer][0]) and torch.equal(values, images[layer][1])
    # Attention reads the borrowed ranks at the new slots, in the same layers' buffers.
    fresh = Compactor(pool, lambda name: None, 2, [10, 11, 12], [], True).prefix_cells(restored.slots, layout)
    assert _cells(restored.prefix_cells) == _cells(fresh) and any(c is not None for c in fresh)
    assert child.input_ids[: restored.num_slots] == list(ids[: restored.num_slots])  # placeholders, as any child
    counts = tiering.counts()
    assert counts["host_restores"] == 1 and counts["host_contexts"] == 0 and counts["host_bytes"] == 0
    admission.forget_all()
    pool.free(restored.slots)
    pool.free(torch.tensor(sorted(set(range(1, 40)) - set(pool.free_slots))))  # the 3 taken above
    assert pool.room() == whole


def _cells(cells):
    """PrefixCells with their slot tensors as lists (comparable)."""
    out = []
    for cell in cells:
        if cell is None:
            out.append(None)
        elif cell.head_borrowed is not None:
            out.append((cell.own, cell.head_own, [[(l, h, s.tolist()) for l, h, s in head] for head in cell.head_borrowed]))
        else:
            out.append((cell.own, [(l, s.tolist()) for l, s in cell.borrowed]))
    return out


def test_a_folded_context_moves_to_host_and_back_into_fresh_slots_byte_for_byte():
    kept = [2, 8, 5]  # layer 1 keeps more than S = 5: its last ranks sit in layer 0's empty cells
    check_round_trip(fold_layers(kept), kept)


def test_a_per_head_context_moves_to_host_and_back_with_its_lent_cells_repointed():
    per_head = [[2, 6], [4, 4], [5, 3]]
    check_round_trip(fold_heads(per_head), [max(h) for h in per_head])


def test_the_longer_context_wins_wherever_it_is():
    """A child reads the longest context it extends, as if nothing had been evicted: a longer one in
    host memory is restored over a shorter one in the pool; a shorter one in host memory is not."""
    pool = TensorPool(slots=40)
    admission = server(pool)
    long_ids, short_ids = tuple(range(200, 212)), tuple(range(200, 206))
    stored_context(pool, admission, long_ids, fold_layers([4] * 3), [4] * 3).last_used = 0.0
    admission.eviction.make_room(pool.room() + 2)
    stored_context(pool, admission, short_ids, fold_layers([3] * 3), [3] * 3)
    child = Child(list(long_ids) + [1])
    assert admit(admission, child).kind == CHILD and child.state.context.n == len(long_ids)
    assert child.state.outcome["restored_from"] == "host" and len(admission.store) == 2
    other = Child(list(short_ids) + [1])
    assert admit(admission, other).kind == CHILD and other.state.context.n == len(short_ids)
    assert "restored_from" not in other.state.outcome


def test_a_child_whose_contexts_room_running_requests_hold_waits_in_the_queue_for_it():
    """Its full prefill would need more room than the restore: it stays queued until the running
    requests end, then reads the restored context -- never a full prefill that depends on what else ran."""
    pool = TensorPool(slots=40)
    whole = pool.room()
    admission = server(pool)
    ids = tuple(range(300, 312))
    stored_context(pool, admission, ids, fold_layers([5] * 3), [5] * 3)
    admission.eviction.make_room(pool.room() + 2)  # the context goes to host memory
    running = pool.alloc(pool.room())  # ... and running requests hold every slot
    child = Child(list(ids) + [1])
    plan = admit(admission, child)
    assert (plan.kind, plan.reason) == (WAIT, WAIT_ROOM) and child.error is None and child.state.waits is True
    assert child.state.context is None and "reason" not in (child.state.outcome or {})
    tiering = admission.eviction.tiering
    assert len(tiering.host) == 1 and tiering.restore_failures == 0 and tiering.restore_waits == 1
    assert tiering.counts()["host_contexts_stored"] == 1  # still where it was, not counted again
    pool.free(running)
    assert pool.room() == whole  # nothing half-restored holds a slot
    assert admit(admission, child).kind == CHILD and child.state.outcome["restored_from"] == "host"  # room again
    admission.forget_all()
    assert len(tiering.host) == 0


def test_a_restore_takes_only_what_the_rounds_budget_leaves_after_the_requests_admitted_before_it():
    """Issue #53 item 1: the pool has free slots, but the requests SGLang admitted earlier in this round
    (their allocation comes later, in prepare_for_extend) reserve them: the restore must not take them.
    The child waits, no slot is taken; the next round (those requests running or done) it is restored."""
    pool = TensorPool(slots=40)
    admission = server(pool)
    ids = tuple(range(500, 512))
    stored_context(pool, admission, ids, fold_layers([5] * 3), [5] * 3)
    admission.eviction.make_room(pool.room() + 2)  # to host memory
    free = pool.room()
    child = Child(list(ids) + [1])
    # An earlier request of the round reserves all but 4 of the free slots: 5 slots plus the child's own
    # tokens do not fit in what is left, though the pool itself could hold them now.
    plan = admit(admission, child, Budget(pool, reserved=free - 4))
    assert (plan.kind, plan.reason) == (WAIT, WAIT_ROOM) and pool.room() == free and child.error is None
    assert len(admission.store) == 0 and len(admission.eviction.tiering.host) == 1
    assert admit(admission, child, Budget(pool, reserved=0)).kind == CHILD and pool.room() == free - 5


def test_a_child_whose_context_can_never_come_back_is_served_by_a_full_prefill_with_the_reason():
    pool = TensorPool(slots=40)
    admission = server(pool)
    ids = tuple(range(600, 612))
    stored_context(pool, admission, ids, fold_layers([5] * 3), [5] * 3)
    admission.eviction.make_room(pool.room() + 2)
    held = next(iter(admission.eviction.tiering.host.entries.values()))
    held.keys[1] = held.keys[1].to(torch.float64)  # no longer this pool's dtype
    child = Child(list(ids) + [1])
    plan = admit(admission, child)
    assert plan.kind == PLAIN and child.error is None and child.state.context is None
    assert "does not fit this server's KV pool" in child.state.outcome["reason"], child.state.outcome
    assert admission.eviction.tiering.restore_failures == 1 and len(admission.eviction.tiering.host) == 0
    assert pool.room() == 39  # nothing was taken


def test_without_the_flag_an_evicted_context_is_dropped():
    pool = TensorPool(slots=40)
    admission = server(pool, host_gb=0.0)
    ids = tuple(range(400, 412))
    stored_context(pool, admission, ids, fold_layers([5] * 3), [5] * 3)
    admission.eviction.make_room(pool.room() + 2)
    assert admission.eviction.evicted == 1 and len(admission.eviction.tiering.host) == 0
    child = Child(list(ids) + [1])
    assert admit(admission, child).kind == PLAIN and child.state.context is None
    assert admission.eviction.tiering.counts()["host_contexts_stored"] == 0


def entry(name: int, size: int, tenant: str | None = None, last_used: float = 0.0) -> TieredContext:
    """A tiered context of ``size`` bytes (keys and values of one layer)."""
    layout = fold_layers([1])
    return TieredContext(context_ids=(name,) * 3, settings=SETTINGS, kept_per_layer=[1], layout=layout,
                         keys=[torch.zeros(size // 2, dtype=torch.uint8)], values=[torch.zeros(size // 2, dtype=torch.uint8)], prefix_cells=[None],
                         tenant=tenant, last_used=last_used)


def test_the_host_tier_holds_at_most_its_bytes_least_recently_used_out_first():
    tier = HostTier(capacity=300)
    assert tier.put(entry(1, 100, last_used=1)) == [] and tier.put(entry(2, 100, last_used=2)) == []
    assert tier.put(entry(3, 100, last_used=3)) == [] and tier.nbytes == 300
    gone = tier.put(entry(4, 100, last_used=4))
    assert [e.context_ids[0] for e in gone] == [1] and tier.nbytes == 300 and len(tier) == 3
    too_big = entry(5, 400)
    assert tier.put(too_big) == [too_big] and len(tier) == 3 and tier.dropped == 2
    assert tier.put(entry(2, 100, last_used=9)) == [] and tier.nbytes == 300  # same key: replaced, not doubled
    tier.release(tier.longest_prefix_of((2, 2, 2, 0), SETTINGS))
    assert tier.nbytes == 200 and tier.longest_prefix_of((2, 2, 2, 0), SETTINGS) is None
    assert tier.longest_prefix_of((3, 3, 3), SETTINGS) is None  # a prompt must strictly extend the context
    tier.clear()
    assert len(tier) == 0 and tier.nbytes == 0


def test_one_tenants_flood_pushes_out_its_own_contexts_first():
    tier = HostTier(capacity=400)
    tier.put(entry(1, 100, "b", last_used=0))  # b's context is the oldest of all
    for i in range(2, 10):
        tier.put(entry(i, 100, "a", last_used=i))
    held = sorted((e.tenant, e.context_ids[0]) for e in tier.entries.values())
    assert held == [("a", 7), ("a", 8), ("a", 9), ("b", 1)], held
