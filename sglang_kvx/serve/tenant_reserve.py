"""Who holds the store's reserve (``--kvx-min-store-fraction``): per tenant, its most recently used
compacted contexts within its share, so one tenant's parents cannot push another's out.

A tenant is a request's ``custom_params.kvx.tenant``. Shares go to **seats**: the first
``--kvx-reserved-tenants`` tenants to hold a context each get one, first come first served, and keep
it while they hold any context; every other tenant and the untagged requests share one more seat.
So a client inventing tenant names lands in the shared seat and cannot dilute a seated tenant's share
(with one share per name, a hundred names would cut everybody's to a hundredth). The reserve is split
evenly over the seats holding contexts; a share a seat leaves unused is split again over the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

SHARED = None  # the seat of untagged requests and of the tenants that found every seat taken


class HeldContext(Protocol):
    tenant: str | None
    num_slots: int
    last_used: float


class TenantReserve:
    """The seats, kept across calls (a seat is the tenant's while it holds a context)."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self._seated: dict[str, None] = {}  # seated tenants, in the order they came

    def seat_of(self, tenant: str | None) -> str | None:
        return tenant if tenant in self._seated else SHARED

    @property
    def seated(self) -> list[str]:
        return list(self._seated)

    def update(self, contexts: Iterable[HeldContext]) -> None:
        """Free the seats of tenants holding nothing; seat newcomers, oldest context first, while seats are left."""
        holding = [c.tenant for c in contexts if c.tenant is not None]
        present = set(holding)
        for tenant in [t for t in self._seated if t not in present]:
            del self._seated[tenant]
        for tenant in holding:  # the store's insertion order: the tenant that came first is seated first
            if tenant not in self._seated and len(self._seated) < self.seats:
                self._seated[tenant] = None

    def reserved(self, contexts: list[HeldContext], budget: int) -> set[int]:
        """ids of the contexts within their seat's share of ``budget`` slots: a seat's most recently
        used contexts that fit its share."""
        by_seat: dict[str | None, list[HeldContext]] = {}
        for context in sorted(contexts, key=lambda c: c.last_used, reverse=True):
            by_seat.setdefault(self.seat_of(context.tenant), []).append(context)
        reserved: set[int] = set()
        while by_seat:  # seats whose contexts all fit an even share: all reserved, the rest split again
            share = budget // len(by_seat)
            whole = [s for s, held in by_seat.items() if sum(c.num_slots for c in held) <= share]
            if not whole:
                break
            for seat in whole:
                held = by_seat.pop(seat)
                budget -= sum(c.num_slots for c in held)
                reserved.update(id(c) for c in held)
        for held in by_seat.values():  # each of the rest: its most recent contexts that fit its share
            left = budget // len(by_seat)
            for context in held:
                if context.num_slots > left:
                    break
                left -= context.num_slots
                reserved.add(id(context))
        return reserved
