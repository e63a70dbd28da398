"""A child whose context is held below the pool (host memory, disk): the context comes back into the
pool only where SGLang's round budget has room for it and for the child, so that nothing the
extension allocates can make SGLang's own allocation for the batch fail (``serve/plans.py``: RESTORE).
Run where SGLang charges the request to the round's budget (``PrefillAdder.add_one_req``)."""

from __future__ import annotations

from sglang_kvx.ports import KVPool, Request, RoundBudget
from sglang_kvx.serve.eviction import StoreEviction
from sglang_kvx.serve.plans import WAIT, WAIT_READ, WAIT_ROOM, Plan, wait
from sglang_kvx.serve.request_state import RequestState
from sglang_kvx.store import ContextStore


class RestoreStep:
    def __init__(self, pool: KVPool, store: ContextStore, eviction: StoreEviction) -> None:
        self.pool = pool
        self.store = store
        self.eviction = eviction
        self.tiering = eviction.tiering

    def admit(self, request: Request, budget: RoundBudget) -> None:
        """Where SGLang charges a request whose plan is RESTORE to the round's budget: its context back
        into the pool if the budget (what the requests admitted before it in this round and the running
        ones leave) holds the context's S slots and the child's own; else it waits (running requests
        hold the room, or its file is still being read) or, when the room can never be had or the
        context cannot come back, its plan is cleared with the reason: the caller matches it again,
        now a child of the restored context, or plain."""
        state = request.state
        held = state.plan.held
        entry = self.tiering.ready(held)
        if entry is None:
            state.plan = Plan(WAIT, held=held, reason=WAIT_READ)
            return
        if isinstance(entry, str):
            return self._restore_failed(state, entry)
        if self.store.get(entry.context_ids, entry.settings) is not None:
            state.plan = None  # another child brought it back meanwhile: this one reads it from the pool
            return
        need = entry.num_slots + self.eviction.slots_wanted(len(request.input_ids) - entry.n, request.max_new_tokens)
        # Idle pooled contexts make way first; what can never be freed for it leaves it to a full prefill.
        never = self.eviction.make_room(need, tenant=state.fields.tenant)
        if never is not None:
            return self._restore_failed(state, self.tiering.failed(
                f"no room in the KV pool for the {entry.num_slots} slots of the {entry.n}-token context held in the "
                f"{held.tier.name} tier and its child ({never})"))
        room = budget.room()
        if room < need:
            if self.eviction.running_slots() > 0 or room < self.pool.room():
                # Requests running, or admitted before it this round, hold the room: free once they end.
                self.tiering.restore_waits += 1
                state.plan = wait(WAIT_ROOM)
                return
            return self._restore_failed(state, self.tiering.failed(  # nothing will free more: never wait for it
                f"no room in the round's budget for the {entry.num_slots} slots of the {entry.n}-token context held "
                f"in the {held.tier.name} tier and its child ({room} of {need})"))
        context, problem = self.tiering.restore(held, entry)
        if context is None:
            if problem is None:
                state.plan = wait(WAIT_ROOM)
                return
            return self._restore_failed(state, problem)
        self.store.add(context, compacted=False)
        state.restored = {"restored_from": held.tier.name, "restore_s": context.timings["restore_s"]}
        state.plan = None

    @staticmethod
    def _restore_failed(state: RequestState, problem: str) -> None:
        """Served as if nothing were stored below the pool: a full prefill, or a child of the pool's best."""
        state.skip_tiers = True
        state.outcome = {"child": False, "reason": problem}  # a child of the pool's best says it as restore_failed
        state.restored = {"restore_failed": problem}
        state.plan = None
