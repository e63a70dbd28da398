"""The compactor and admission run on plain views: a KV pool of tensors, no server."""

from __future__ import annotations

import torch

from sglang_kvx.compact.compactor import Compactor
from sglang_kvx.config import KvxConfig, make_policy
from sglang_kvx.serve.admission import Admission
from sglang_kvx.settings import CompactionSettings, ServerDefaults
from sglang_kvx.store import ContextStore


class TensorPool:
    """A KV pool of tensors: per layer [slots, heads, D] keys and values, one request row table."""

    def __init__(self, num_layers=3, slots=64, heads=2, dim=4, row_width=32, state=None) -> None:
        torch.manual_seed(0)
        self.keys = [torch.randn(slots, heads, dim) for _ in range(num_layers)]
        self.values = [torch.randn(slots, heads, dim) for _ in range(num_layers)]
        self.rows = torch.zeros(4, row_width, dtype=torch.long)
        self.free_slots = list(range(1, slots))
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, heads, dim
        self.bytes_per_entry = 2 * heads * dim * 4
        self.can_fold, self.has_state, self.device, self.dtype = True, state is not None, torch.device("cpu"), torch.float32
        self.total = slots
        self.state = state  # one state slot's snapshot, as a hybrid model's pool gives it (None: a dense model)

    def state_template(self):
        return self.state

    def layer_id(self, layer):
        return 10 + layer

    def read_keys(self, layer, slots):
        return self.keys[layer][slots]

    def read(self, layer, slots):
        return self.keys[layer][slots], self.values[layer][slots]

    def write(self, layer, slots, keys, values):
        self.keys[layer][slots], self.values[layer][slots] = keys, values

    def row(self, row, length):
        return self.rows[row, :length]

    def alloc(self, count):
        if count > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        return torch.tensor(taken, dtype=torch.long)

    def free(self, slots):
        self.free_slots += slots.tolist()

    def room(self):
        return len(self.free_slots)


def test_compaction_gathers_each_heads_kept_entries_in_rank_order_into_its_own_slots():
    pool = TensorPool()
    n = 20
    context_slots = pool.alloc(n)
    before = [(k.clone(), v.clone()) for k, v in zip(pool.keys, pool.values)]
    policy = make_policy("keydiff", KvxConfig())
    compactor = Compactor(pool, lambda name: policy, num_q_heads=2, attention_layer_ids=[10, 11, 12],
                          gdn_layer_ids=[], per_layer_lengths=True)
    settings = CompactionSettings("keydiff", 0.25, 2, "flat")
    context = compactor.compact(tuple(range(n)), context_slots, settings, take_slots=lambda s: context_slots[:s].clone(),
                                fill_signals=lambda signals: None, gdn_snapshot=None, timings={})
    assert context.kept_per_layer == [7, 7, 7] and context.num_slots == 7 and context.settings == settings
    for layer, positions in enumerate(context.keep_positions):
        keys, values = before[layer]
        for head in range(2):
            kept_slots = context_slots[positions[head]]
            # Rank i of head h sits in slot i, read from the pool as it was before compaction.
            assert torch.equal(pool.keys[layer][context.slots, head], keys[kept_slots, head])
            assert torch.equal(pool.values[layer][context.slots, head], values[kept_slots, head])
        assert positions[:, :2].tolist() == [[0, 1], [0, 1]]  # the protected prefix


def test_keys_are_read_only_for_the_layers_a_policy_scores():
    pool = TensorPool()
    reads = []
    original = pool.read_keys
    pool.read_keys = lambda layer, slots: reads.append(layer) or original(layer, slots)
    compactor = Compactor(pool, lambda name: make_policy(name, KvxConfig()), 2, [10, 11, 12], [], True)
    signals = compactor.read_signals(pool.alloc(10), 0)
    assert reads == []  # nothing read yet
    signals.keys[1]
    assert reads == [1]  # one layer, when asked
    compactor.choose(signals, CompactionSettings("streamingllm", 0.5, 0, "flat"))
    assert reads == [1]  # StreamingLLM reads positions only: no keys


def test_admission_evicts_the_least_recently_used_idle_context_for_room():
    pool = TensorPool(slots=16)
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset()), num_rows=4)
    from sglang_kvx.compact.layout import fold_layers
    from sglang_kvx.store import CompactedContext

    contexts = []
    for i in range(3):
        slots = pool.alloc(5)
        context = CompactedContext(context_ids=(i,) * 6, settings=CompactionSettings("knorm", 0.5, 0, "flat"),
                                   slots=slots, kept_per_layer=[5, 5, 5], layout=fold_layers([5, 5, 5]))
        context.last_used = float(i)
        store.add(context)
        contexts.append(context)
    contexts[0].active_children = 1  # in use: never evicted
    admission.eviction.make_room(6)
    assert admission.eviction.evicted == 2 and pool.room() == 10  # oldest idle first, until it fits
    assert list(store.contexts.values()) == [contexts[0]]


def _store_with(pool, store, sizes, tenants=None, first: int = 0):
    from sglang_kvx.compact.layout import fold_layers
    from sglang_kvx.store import CompactedContext

    contexts = []
    for i, size in enumerate(sizes, start=first):
        context = CompactedContext(context_ids=(i,) * (size + 1), settings=CompactionSettings("knorm", 0.5, 0, "flat"),
                                   slots=pool.alloc(size), kept_per_layer=[size] * 3, layout=fold_layers([size] * 3))
        context.last_used = float(i)
        context.tenant = tenants[i - first] if tenants else None
        store.add(context)
        contexts.append(context)
    return contexts


def test_the_reserved_share_of_the_store_is_never_evicted():
    pool = TensorPool(slots=17)  # 16 usable slots
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.4), num_rows=4)
    old, middle, recent = _store_with(pool, store, [5, 5, 5])  # 0.4 x 17 = 6 slots reserved: the most recent context
    admission.eviction.make_room(11)
    assert list(store.contexts.values()) == [recent] and admission.eviction.evicted == 2
    # Only the reserved context is left: it stays, and the request is refused -- it could never be admitted.
    problem = admission.eviction.make_room(16)
    assert list(store.contexts.values()) == [recent] and admission.eviction.refused == 1
    assert problem is not None and "needs 16 KV slots" in problem and "5 hold other tenants' compacted contexts" in problem
    assert admission.eviction.make_room(11) is None  # what fits beside the reserve is admitted


def test_a_request_waits_only_for_what_will_end_and_is_refused_otherwise():
    """A request waits (SGLang queues it) for running requests and children in flight, never for
    the reserve: one that could only fit by evicting it is refused at once, or it would wait for
    good, and every request behind it with it."""
    pool = TensorPool(slots=17)  # 16 usable
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.4), num_rows=4)
    old, recent = _store_with(pool, store, [4, 5])  # the recent one reserved (6 slots), the old one in use
    old.active_children = 1
    running = pool.alloc(3)
    assert pool.room() == 4
    assert admission.eviction.make_room(11) is None and len(store) == 2  # 4 free + 3 running + 4 in use: it waits
    problem = admission.eviction.make_room(13)  # 13 > 17 - 5 reserved (the pool counts its padding slot): never
    assert problem is not None and "needs 13 KV slots" in problem and len(store) == 2
    # The reserved context's own tenant may evict it: nothing is out of reach then.
    recent.tenant = "t"
    assert admission.eviction.make_room(13, tenant="t") is None
    pool.free(running)


def test_idle_contexts_make_way_even_while_running_requests_would_free_the_room():
    """As SGLang evicts its prefix cache for a queued request rather than making it wait for running
    ones to end (a running request may decode for minutes), idle contexts go for it."""
    pool = TensorPool(slots=17)
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.0), num_rows=4)
    older, newer = _store_with(pool, store, [5, 5])
    running = pool.alloc(5)  # a running request's KV
    assert pool.room() == 1
    assert admission.eviction.make_room(6) is None  # 1 free + 5 back when the running request ends: evicted anyway
    assert list(store.contexts.values()) == [newer] and admission.eviction.evicted == 1  # the least recently used
    pool.free(running)


def test_make_way_evicts_one_idle_context_per_call_never_the_one_a_child_reads():
    """SGLang's own budget check turned a request away: one idle context goes per call, least recently
    used first, never the child's own context; False once none is left."""
    pool = TensorPool(slots=17)
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.0), num_rows=4)
    older, newer, read = _store_with(pool, store, [3, 3, 3])
    assert admission.eviction.make_way(keep=read, tenant=None) and list(store.contexts.values()) == [newer, read]
    assert admission.eviction.make_way(keep=read, tenant=None) and list(store.contexts.values()) == [read]
    assert not admission.eviction.make_way(keep=read, tenant=None) and admission.eviction.evicted_for_budget == 2


def test_one_tenants_parents_cannot_evict_another_tenants_share_of_the_reserve():
    pool = TensorPool(slots=41)  # 40 usable slots; 0.5 x 41 = 20 reserved: 10 per tenant while two hold contexts
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.5), num_rows=4)
    b_old, *a_contexts = _store_with(pool, store, [5, 5, 5, 5, 5, 5], tenants=["b", "a", "a", "a", "a", "a"])
    # b holds 5 of its 10: its context, and a's three most recent (15 of the 15 left to a), are reserved.
    assert admission.eviction.reserved_slots() == 20
    admission.eviction.make_room(25, tenant="a")  # a's parents: what nobody reserves, then a's own, oldest first
    assert b_old in store.contexts.values()  # b's context is older than all of a's, and still there
    assert len(store) == 3 and admission.eviction.evicted == 3 and pool.room() == 25
    admission.eviction.make_room(36, tenant="a")  # only b's reserved context is left: refused
    assert b_old in store.contexts.values() and admission.eviction.refused == 1
    admission.eviction.make_room(37)  # nor can an untagged request take it
    assert b_old in store.contexts.values() and admission.eviction.refused == 2
    admission.eviction.make_room(37, tenant="b")  # b may evict its own
    assert len(store) == 0


def test_a_share_a_tenant_leaves_unused_goes_to_the_others():
    pool = TensorPool(slots=41)
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.5), num_rows=4)
    _store_with(pool, store, [2, 5, 5, 5, 5], tenants=["b", "a", "a", "a", "a"])
    # b holds 2 of its 10: a may keep 18 -> its three most recent contexts (15 slots).
    assert admission.eviction.reserved_slots() == 17


def test_inventing_tenant_names_cannot_dilute_a_seated_tenants_share():
    """The victim stores its context; then a client sends parents under 100 invented tenant names.
    Seats go first come first served (``--kvx-reserved-tenants``): the names past the seats share one
    share, so the victim's share stays a fixed fraction of the reserve and its context is never evicted
    by the others' parents (with one share per name it would fall to a hundredth)."""
    pool = TensorPool(slots=1201)  # 1200 usable slots; 0.5 x 1201 = 600 reserved
    store = ContextStore()
    defaults = ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.5, reserved_tenants=3)
    admission = Admission(pool, store, defaults, num_rows=4)
    (victim,) = _store_with(pool, store, [100], tenants=["victim"])
    for i in range(100):  # each invented tenant's parent, made room for like any request
        assert admission.eviction.make_room(10, tenant=f"t{i}") is None
        (context,) = _store_with(pool, store, [10], tenants=[f"t{i}"], first=1000 + i)
        context.last_used = 1000.0 + i  # every one more recent than the victim's
    assert victim in store.contexts.values()
    # Four seats hold contexts (three tenants, and the shared one): a quarter of 600 each, the victim's 100 within it.
    assert id(victim) in admission.eviction._reserved(None)
    assert admission.eviction.tenant_reserve.seated == ["victim", "t0", "t1"]  # seated in the order their contexts came
    for i in range(100, 200):  # the pool fills: the invented tenants' parents now evict, never the victim's
        assert admission.eviction.make_room(50, tenant=f"t{i}") is None
        _store_with(pool, store, [50], tenants=[f"t{i}"], first=2000 + i)[0].last_used = 2000.0 + i
    assert victim in store.contexts.values() and admission.eviction.evicted > 0
    admission.eviction.make_room(1100)  # an untagged request asking for nearly the whole pool: never the victim's context
    assert victim in store.contexts.values()


def test_a_decode_step_short_of_room_takes_idle_unreserved_contexts_only():
    """The running requests' next decode step lacks room (SGLang would retract one of them, which cannot
    take the store's slots): idle contexts no reserve keeps go first, oldest first; a context in use or
    within the reserve never does."""
    pool = TensorPool(slots=17)  # 16 usable
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.3), num_rows=4)
    in_use, old, middle, recent = _store_with(pool, store, [2, 3, 3, 4])  # 0.3 x 17 = 5: the most recent reserved
    in_use.active_children = 1
    running = pool.alloc(pool.room())  # the running requests hold every free slot
    assert admission.eviction.free_idle(2) and list(store.contexts.values()) == [in_use, middle, recent]
    assert pool.room() == 3  # the oldest idle context's 3 slots: enough, so the middle one stays
    assert admission.eviction.free_idle(6) and list(store.contexts.values()) == [in_use, recent]
    assert not admission.eviction.free_idle(20)  # only the reserved and the in-use contexts are left
    assert list(store.contexts.values()) == [in_use, recent] and admission.eviction.evicted == 2
    # A prefill batch's allocation that would fail (SGLang did not budget it: a chunked request's next
    # chunk) takes the reserved one too; never the one in use.
    assert admission.eviction.free_idle(20, reserved_too=True) and list(store.contexts.values()) == [in_use]
    pool.free(running)


def test_what_a_request_can_never_evict_is_the_other_tenants_reserve():
    pool = TensorPool(slots=33)
    store = ContextStore()
    admission = Admission(pool, store, ServerDefaults("knorm", 0.5, 0, frozenset(), min_store_fraction=0.5), num_rows=4)
    _store_with(pool, store, [4, 5, 6], tenants=["a", "b", None])
    reserved = admission.eviction.reserved_slots()
    assert reserved == 15  # 0.5 x 33 = 16 slots of reserve hold all three
    assert admission.eviction.kept_from(None) == 15  # an untagged request evicts no reserved context
    assert admission.eviction.kept_from("a") == 11 and admission.eviction.kept_from("b") == 10  # its own it may
