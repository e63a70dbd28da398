"""Moving compacted contexts between the KV pool and the tiers below it (``store/tiers.py``).

``offload`` runs when the pool evicts a context (``serve/eviction.py``): before its slots are freed,
each attention layer's buffer over the context's S slots is copied to the host -- the folded layout
keeps every kept rank inside those S cells of some layer, so this is exactly the kept bytes, and
the same copy serves flat, folded and per-head layouts alike. ``restore`` (``serve/admission.py``,
when a child's longest stored prefix is in a tier) takes S fresh slots from the pool's allocator,
writes the bytes back (one copy) and rebuilds the ``CompactedContext`` with its cells re-pointed at
the new slots; the child then adopts it exactly as a context that never left. When the pool cannot
give the slots, the entry goes back to its tier and the child is served as if nothing were stored
(a full prefill): never a stall.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from sglang_kvx.compact.layout import PrefixLayout
from sglang_kvx.ports import KVPool
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.store import CompactedContext, PrefixCells
from sglang_kvx.store.tiers import ContextTier, HostTier, TieredContext

logger = logging.getLogger(__name__)

GB = 10**9  # --kvx-host-store-gb counts decimal gigabytes


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, pinned when it comes from a GPU (the copy back can then be async)."""
    if tensor.device.type == "cpu":
        return tensor.clone()  # the pool's read may be a view on some backends: never alias the pool
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(tensor)
    return host


def repoint_cells(cells: list[PrefixCells | None], layout: PrefixLayout, slots: torch.Tensor) -> list[PrefixCells | None]:
    """``cells`` of a context whose S slots are now ``slots``: every borrowed range read from the layout."""
    out: list[PrefixCells | None] = []
    for layer, cell in enumerate(cells):
        if cell is None:
            out.append(None)
        elif cell.head_borrowed is not None:
            heads = layout.heads[layer]
            out.append(cell._replace(head_borrowed=tuple(
                tuple((layer_id, head, slots[b.start:b.end]) for (layer_id, head, _), b in zip(ranges, heads[h].borrowed))
                for h, ranges in enumerate(cell.head_borrowed))))
        else:
            borrowed = layout.layers[layer].borrowed
            out.append(cell._replace(borrowed=tuple(
                (layer_id, slots[b.start:b.end]) for (layer_id, _), b in zip(cell.borrowed, borrowed))))
    return out


class Tiering:
    """The tiers below the pool (host memory when ``host_bytes`` > 0) and the moves between them."""

    def __init__(self, pool: KVPool, host_bytes: int) -> None:
        self.pool = pool
        self.host = HostTier(host_bytes)
        self.known: list[ContextTier] = [self.host]  # reported even when off (0 held), so /metrics keeps its names
        self.tiers: list[ContextTier] = [self.host] if host_bytes > 0 else []  # in order, first to take evictions
        self.moved_in = {tier.name: 0 for tier in self.known}  # contexts the pool evicted into each tier
        self.restores = {tier.name: 0 for tier in self.known}
        self.restore_seconds = {tier.name: 0.0 for tier in self.known}
        self.restore_failures = 0  # a child fell back to a full prefill: the pool could not take its context back
        self.last_restore_failure: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def holds_any(self) -> bool:
        return any(len(tier) for tier in self.tiers)

    def offload(self, context: CompactedContext) -> None:
        """Copy an evicted context into the first tier (before the pool frees its slots)."""
        if not self.tiers or context.num_slots == 0:
            return
        keys, values = [], []
        for layer in range(self.pool.num_layers):
            k, v = self.pool.read(layer, context.slots)
            keys.append(_to_host(k))
            values.append(_to_host(v))
        entry = TieredContext(
            context_ids=context.context_ids, settings=context.settings, kept_per_layer=list(context.kept_per_layer),
            layout=context.layout, keys=keys, values=values, prefix_cells=list(context.prefix_cells),
            keep_positions=context.keep_positions, gdn_snapshot=context.gdn_snapshot, timings=dict(context.timings),
            tenant=context.tenant, reuse_count=context.reuse_count, last_used=context.last_used)
        tier = self.tiers[0]
        dropped = tier.put(entry)
        if entry not in dropped:
            self.moved_in[tier.name] += 1
        for gone in dropped:  # no tier below yet: a disk tier would take these
            logger.info("sglang_kvx: %s tier let a %d-token context go (%d bytes)", tier.name, gone.n, gone.nbytes)

    def restore(self, prompt_ids, settings: CompactionSettings, beaten: int,
                make_room: Callable[[int], None]) -> tuple[CompactedContext | None, str | None]:
        """The longest tiered context the prompt extends, longer than ``beaten`` tokens (what the pool
        holds for it), back in the pool: (context, its tier's name), or (None, why not) -- why is None
        when no tier holds one. ``make_room(S)`` asks the pool's eviction for S slots first."""
        found = self._longest(prompt_ids, settings, beaten)
        if found is None:
            return None, None
        tier, entry = found
        tier.take(entry)  # out first: evictions making room below must not push it out of its tier
        start = time.perf_counter()
        make_room(entry.num_slots)
        slots = self.pool.alloc(entry.num_slots)
        if slots is None:
            tier.put(entry)
            self.restore_failures += 1
            self.last_restore_failure = (f"no room in the KV pool for the {entry.num_slots} slots of the "
                                         f"{entry.n}-token context held in {tier.name} memory")
            return None, self.last_restore_failure
        device = slots.device
        for layer, (keys, values) in enumerate(zip(entry.keys, entry.values)):
            self.pool.write(layer, slots, keys.to(device, non_blocking=True), values.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the host copy may be dropped once this returns
        seconds = time.perf_counter() - start
        self.restores[tier.name] += 1
        self.restore_seconds[tier.name] += seconds
        context = CompactedContext(
            context_ids=entry.context_ids, settings=entry.settings, slots=slots, kept_per_layer=entry.kept_per_layer,
            layout=entry.layout, keep_positions=entry.keep_positions, gdn_snapshot=entry.gdn_snapshot,
            timings={**entry.timings, "restore_s": seconds, "restored_from": tier.name},
            prefix_cells=repoint_cells(entry.prefix_cells, entry.layout, slots), tenant=entry.tenant,
            reuse_count=entry.reuse_count)
        return context, tier.name

    def _longest(self, prompt_ids, settings: CompactionSettings, beaten: int) -> tuple[ContextTier, TieredContext] | None:
        best = None
        for tier in self.tiers:
            entry = tier.longest_prefix_of(prompt_ids, settings)
            if entry is not None and entry.n > beaten and (best is None or entry.n > best[1].n):
                best = (tier, entry)
        return best

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def counts(self) -> dict[str, float]:
        """Per tier: contexts and bytes held, moves in, contexts let go, restores and their seconds."""
        out: dict[str, float] = {"restore_failures": self.restore_failures}
        for tier in self.known:
            name = tier.name
            out.update({f"{name}_contexts": len(tier), f"{name}_bytes": tier.nbytes, f"{name}_capacity_bytes": tier.capacity,
                        f"{name}_contexts_stored": self.moved_in[name], f"{name}_contexts_dropped": tier.dropped,
                        f"{name}_restores": self.restores[name], f"{name}_restore_seconds": self.restore_seconds[name]})
        return out
