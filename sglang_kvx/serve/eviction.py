"""Making room in the pool for a waiting request: which idle compacted contexts go, which the store's
reserve keeps (``--kvx-min-store-fraction``, shared over tenants by ``serve/tenant_reserve.py``), and
when a request can never fit (refused at once instead of queued for good)."""

from __future__ import annotations

import logging
from typing import Callable

from sglang_kvx.ports import KVPool
from sglang_kvx.serve.tenant_reserve import TenantReserve
from sglang_kvx.serve.tiering import GB, Tiering
from sglang_kvx.settings import ServerDefaults
from sglang_kvx.store.disk import DiskTier
from sglang_kvx.store.context_file import read_secret
from sglang_kvx.store.fit_check import PoolFacts
from sglang_kvx.store import CompactedContext, ContextStore

logger = logging.getLogger(__name__)


class StoreEviction:
    def __init__(self, pool: KVPool, store: ContextStore, defaults: ServerDefaults, held_slots: Callable[[], int]) -> None:
        self.pool = pool
        self.store = store
        self.defaults = defaults
        self.held_slots = held_slots  # slots held outside requests and the prefix cache
        self.tenant_reserve = TenantReserve(defaults.reserved_tenants)  # whose contexts the store's reserve keeps
        self.evicted = 0
        self.evicted_for_budget = 0  # of those, where SGLang's round budget could not hold a request
        self.refused = 0  # times the rest of the store was reserved or in use: no eviction
        # Where evicted contexts go instead of nowhere (--kvx-host-store-gb), and come back from.
        facts = PoolFacts.of(pool)
        disk = (DiskTier(defaults.context_dir, int(defaults.disk_store_gb * GB), defaults.model_fingerprint, facts,
                         read_secret(defaults.context_secret_file)) if defaults.context_dir else None)
        self.tiering = Tiering(pool, int(defaults.host_store_gb * GB), disk, persist=defaults.persist_contexts,
                               facts=facts)
        store.on_add.append(self.tiering.stored)

    def slots_wanted(self, prompt_tokens: int, max_new_tokens: int | None) -> int:
        """What a request will need as SGLang's PrefillAdder counts it: the prompt in whole pages, its
        growth clipped as SGLang clips it when admitting (a huge max_new_tokens reserves no more than
        that), one page of rounding, and one slot more: SGLang admits only a total *below* its budget.
        One slot less and a request SGLang cannot admit is judged to fit (a 2,791-token prompt with 16
        new tokens against 2,808 free and evictable slots: queued for good, nothing running to free
        room, under SGLang's bench_serving). ``make_way`` backs this estimate with SGLang's own check."""
        page = self.defaults.page_size
        return -(-prompt_tokens // page) * page + min(max_new_tokens or 0, self.defaults.growth_estimate_cap) + page + 1

    def make_room(self, tokens: int, keep: CompactedContext | None = None, tenant: str | None = None) -> str | None:
        """Evict idle compacted contexts, least recently used first, while the pool (free slots plus
        what the prefix cache can evict) cannot hold a waiting request of ``tokens`` tokens, as
        SGLang evicts its prefix cache's entries for it: a request never waits for running requests
        to end while idle contexts hold the room (one of them may run for minutes).

        Never another tenant's contexts within its share of the store's reserve
        (``--kvx-min-store-fraction``): a request may evict what no tenant reserves, then its own
        tenant's contexts (``custom_params.kvx.tenant``; untagged requests only the former). Returns
        why the request can never be admitted (None: it fits now or will once running requests and
        children end): what it may never evict is too much of the pool."""
        room = self.pool.room()
        if room >= tokens:
            return None
        reserved = self._reserved(keep)
        while room < tokens:
            if not self._evict_lru(self._takeable(keep, tenant, reserved), reserved, "to make room"):
                self.refused += 1  # what is left is reserved or in use
                return self._never_fits(tokens, room, keep, reserved, tenant)
            room = self.pool.room()

    def make_way(self, keep: CompactedContext | None, tenant: str | None) -> bool:
        """SGLang's round budget could not hold a request (its own check, which ``slots_wanted`` only
        estimates: it pins the request's matched prefix, reserves the running requests' growth and
        what this round admitted): one more idle context goes, as ``make_room`` chooses it. Whether
        one went (the caller asks SGLang again)."""
        reserved = self._reserved(keep)
        if not self._evict_lru(self._takeable(keep, tenant, reserved), reserved, "for a request SGLang's budget could not hold"):
            return False
        self.evicted_for_budget += 1
        return True

    @staticmethod
    def _takeable(keep: CompactedContext | None, tenant: str | None, reserved: set[int]) -> Callable[[CompactedContext], bool]:
        """What a request may evict: never the context it reads; what no tenant reserves, and its own tenant's."""
        return lambda c: c is not keep and (id(c) not in reserved or (tenant is not None and c.tenant == tenant))

    def _evict_lru(self, may_take: Callable[[CompactedContext], bool], reserved: set[int], why: str) -> bool:
        """The least recently used idle context ``may_take`` allows, the reserved ones last, out of the
        pool; whether there was one."""
        idle = [c for c in self.store.contexts.values() if c.active_children == 0 and may_take(c)]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (id(c) in reserved, c.last_used))
        self.evict(victim)
        logger.info("sglang_kvx: evicted a compacted %d-token context (%d slots) %s", victim.n, victim.num_slots, why)
        return True

    def running_slots(self, room: int | None = None) -> int:
        """Slots held by requests now in flight (neither free, nor evictable, nor the store's)."""
        return self.pool.total - (self.pool.room() if room is None else room) - self.held_slots()

    def evict(self, victim: CompactedContext) -> None:
        """Out of the pool: its kept entries are copied to the tiers below (when on) before its slots are freed."""
        self.tiering.offload(victim)
        self.store.remove(victim)
        self.pool.free(victim.slots)
        self.evicted += 1

    def _never_fits(self, tokens: int, room: int, keep: CompactedContext | None, reserved: set[int],
                    tenant: str | None) -> str | None:
        """Why ``tokens`` slots will never be free for this request (None: they will, once the running
        requests end and the children in flight release their contexts)."""
        running = self.running_slots(room)
        mine = {id(c) for c in self.store.contexts.values()
                if c is not keep and (id(c) not in reserved or (tenant is not None and c.tenant == tenant))}
        if room + running + sum(c.num_slots for c in self.store.contexts.values() if id(c) in mine) >= tokens:
            return None  # SGLang queues it until then
        others = sum(c.num_slots for c in self.store.contexts.values() if c is not keep and id(c) not in mine)
        held = f"{others} hold other tenants' compacted contexts within the store's reserve (--kvx-min-store-fraction)"
        if keep is not None:
            held += f" and {keep.num_slots} the context it reads"
        return (f"the request needs {tokens} KV slots (its prompt and its max_new_tokens, counted up to "
                f"{self.defaults.growth_estimate_cap} as SGLang counts them), more than this server can free for it: of the pool's {self.pool.total} slots, {held}; "
                f"ask for fewer max_new_tokens or send a shorter prompt")

    def free_idle(self, tokens: int, reserved_too: bool = False) -> bool:
        """The pool lacks ``tokens`` slots for what SGLang is about to allocate outside admission: give up
        idle contexts no tenant's reserve keeps, least recently used first -- a decode step of the
        running requests, before SGLang retracts one (it cannot take the store's slots; on plain SGLang
        that room would be free). ``reserved_too`` (a prefill batch's allocation, which would fail):
        then the reserved ones. Whether anything was freed."""
        reserved = self._reserved(None)
        why = "for a prefill batch's allocation" if reserved_too else "for running requests' decode"
        freed = False
        while self.pool.room() < tokens and self._evict_lru(lambda c: reserved_too or id(c) not in reserved, reserved, why):
            freed = True
        return freed

    def kept_from(self, tenant: str | None) -> int:
        """Slots a request of ``tenant`` can never evict: other tenants' contexts within their share of
        the store's reserve (all reserved contexts for an untagged request)."""
        reserved = self._reserved(None)
        return sum(c.num_slots for c in self.store.contexts.values()
                   if id(c) in reserved and (tenant is None or c.tenant != tenant))

    def reserved_slots(self) -> int:
        """Slots of the contexts no other tenant's request can evict now."""
        reserved = self._reserved(None)
        return sum(c.num_slots for c in self.store.contexts.values() if id(c) in reserved)

    def _reserved(self, keep: CompactedContext | None) -> set[int]:
        """ids of the contexts within their tenant's share of the store's reserve (``serve/tenant_reserve.py``)."""
        contexts = list(self.store.contexts.values())
        self.tenant_reserve.update(contexts)
        return self.tenant_reserve.reserved([c for c in contexts if c is not keep],
                                            int(self.defaults.min_store_fraction * self.pool.total))
