"""Moving compacted contexts between the KV pool and the tiers below it (``store/tiers.py``).

``offload`` runs when the pool evicts a context (``serve/eviction.py``): before its slots are freed,
each attention layer's buffer over the context's S slots is copied to the host -- the folded layout
keeps every kept rank inside those S cells of some layer, so this is exactly the kept bytes, and
the same copy serves flat, folded and per-head layouts alike. A child whose longest stored prefix
is held below the pool (``locate``) gets it back in two steps: ``ready`` (host memory: at once; the
disk: once the tier's worker has read and checked its file, the child waiting in SGLang's queue
meanwhile) and ``restore``, which admission runs only where the round's budget holds the context's
S slots (``serve/admission.py``): the context is checked against the pool before a slot is taken,
S fresh slots are taken, the bytes written back (one copy) and the ``CompactedContext`` rebuilt with
its cells re-pointed at the new slots; whatever fails after the slots were taken gives them back.
A context that cannot come back leaves its child to a full prefill with the reason in its
meta_info: never a stall, never a wrong answer. The host tier's let-go entries go down to the disk
tier (``store/disk.py``), which also takes every stored context at once with ``--kvx-persist-contexts``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_kvx.compact.layout import PrefixLayout
from sglang_kvx.ports import KVPool
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.store import CompactedContext, PrefixCells
from sglang_kvx.store.disk import DiskTier
from sglang_kvx.store.fit_check import PoolFacts, misfit
from sglang_kvx.store.tiers import ContextTier, HostTier, TieredContext

logger = logging.getLogger(__name__)

GB = 10**9  # --kvx-host-store-gb and --kvx-disk-store-gb count decimal gigabytes
TIER_NAMES = ("host", "disk")


@dataclass(frozen=True)
class Held:
    """A context a prompt extends, held in a tier below the pool (``entry``: what that tier holds of it)."""

    tier: ContextTier
    entry: Any

    @property
    def n(self) -> int:
        return self.entry.n

    @property
    def settings(self) -> CompactionSettings:
        return self.entry.settings

    @property
    def per_head(self) -> bool:
        return self.entry.per_head


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
    """The tiers below the pool -- host memory when ``host_bytes`` > 0, then ``disk`` when given -- and
    the moves between them. With ``persist`` every stored context is written to disk at once, so it
    outlives the process (a restart, kill -9 included, restores it from there)."""

    def __init__(self, pool: KVPool, host_bytes: int, disk: DiskTier | None = None, persist: bool = False,
                 facts: PoolFacts | None = None) -> None:
        self.pool = pool
        self.facts = facts or PoolFacts.of(pool)
        self.host = HostTier(host_bytes)
        self.disk = disk
        self.persist_all = persist and disk is not None
        # In order, the first taking the pool's evictions and each the one above's let-go entries.
        self.tiers: list[ContextTier] = ([self.host] if host_bytes > 0 else []) + ([disk] if disk is not None else [])
        self.moved_in = dict.fromkeys(TIER_NAMES, 0)  # contexts evicted into each tier (from the pool or the tier above)
        self.restores = dict.fromkeys(TIER_NAMES, 0)
        self.restore_seconds = dict.fromkeys(TIER_NAMES, 0.0)
        self.restore_failures = 0  # a child fell back to a full prefill: its context could not come back
        self.restore_waits = 0  # rounds a child stayed queued: its restore's room was held by running requests
        self.last_restore_failure: str | None = None

    def holds_any(self) -> bool:
        return any(tier.holds_any() for tier in self.tiers)

    def copy_out(self, context: CompactedContext) -> TieredContext:
        """A host copy of a pooled context: each attention layer's buffer over its S slots, and the rest."""
        keys, values = [], []
        for layer in range(self.pool.num_layers):
            k, v = self.pool.read(layer, context.slots)
            keys.append(_to_host(k))
            values.append(_to_host(v))
        return TieredContext(
            context_ids=context.context_ids, settings=context.settings, kept_per_layer=list(context.kept_per_layer),
            layout=context.layout, keys=keys, values=values, prefix_cells=list(context.prefix_cells),
            keep_positions=context.keep_positions, gdn_snapshot=context.gdn_snapshot,
            timings={k: v for k, v in context.timings.items() if k not in ("restore_s", "restored_from")},
            tenant=context.tenant, reuse_count=context.reuse_count, last_used=context.last_used)

    def offload(self, context: CompactedContext) -> None:
        """Copy an evicted context into the first tier (before the pool frees its slots)."""
        if not self.tiers or context.num_slots == 0:
            return
        if self.tiers[0] is self.disk and self.disk.holds(context.context_ids, context.settings):
            self.moved_in[self.disk.name] += 1  # persisted when stored: nothing to copy
            return
        self._put(0, self.copy_out(context))

    def stored(self, context: CompactedContext) -> None:
        """A context just entered the store: queued for the disk now with ``--kvx-persist-contexts``."""
        if self.persist_all and context.num_slots and not self.disk.holds(context.context_ids, context.settings):
            self.disk.put(self.copy_out(context))

    def _put(self, index: int, entry: TieredContext, moved: bool = True) -> None:
        """``entry`` into tier ``index``, what it lets go into the next one (``moved``: a new arrival,
        counted; not a failed restore putting it back)."""
        tier = self.tiers[index]
        let_go = tier.put(entry)
        if moved and all(gone is not entry for gone in let_go):
            self.moved_in[tier.name] += 1
        for gone in let_go:
            if index + 1 < len(self.tiers) and isinstance(gone, TieredContext):
                self._put(index + 1, gone)
            else:
                logger.info("sglang_kvx: %s tier let a %d-token context go (%d bytes)", tier.name, gone.n, gone.nbytes)

    # --- back into the pool ----------------------------------------------------------------------

    def locate(self, prompt_ids, settings: CompactionSettings, beaten: int) -> Held | None:
        """The longest context held below the pool that the prompt extends, longer than ``beaten``
        tokens (what the pool holds for it)."""
        best = None
        for tier in self.tiers:
            entry = tier.longest_prefix_of(prompt_ids, settings)
            if entry is not None and entry.n > beaten and (best is None or entry.n > best.n):
                best = Held(tier, entry)
        return best

    def ready(self, held: Held) -> TieredContext | str | None:
        """``held``'s context in host memory, checked against the pool: the context, why it cannot come
        back (counted; the child is then served by a full prefill), or None while the disk tier reads it."""
        fetched = held.tier.fetch(held.entry)
        if fetched is None:
            return None
        if isinstance(fetched, str):
            return self.failed(f"the {held.n}-token context in the {held.tier.name} tier cannot come back: {fetched}; "
                               f"served by a full prefill")
        # A file was checked whole by the tier's worker; host memory holds copies of our own pool's bytes.
        if problem := misfit(fetched, self.facts, values=False):
            held.tier.release(held.entry)
            return self.failed(f"the {fetched.n}-token context in the {held.tier.name} tier does not fit this "
                               f"server's KV pool ({problem}); served by a full prefill")
        return fetched

    def restore(self, held: Held, entry: TieredContext) -> tuple[CompactedContext | None, str | None]:
        """``entry`` (``ready``'s) into S fresh slots of the pool: (context, None); (None, None) when the pool
        has not the slots (the caller checked its budget: this is a race it waits out); (None, why) when
        writing it back failed -- the slots taken are given back first."""
        start = time.perf_counter()
        slots = self.pool.alloc(entry.num_slots)
        if slots is None:
            return None, None
        try:
            device = slots.device
            for layer, (keys, values) in enumerate(zip(entry.keys, entry.values)):
                self.pool.write(layer, slots, keys.to(device, non_blocking=True), values.to(device, non_blocking=True))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the host copy may be dropped once this returns
            cells = repoint_cells(entry.prefix_cells, entry.layout, slots)
        except Exception as exc:  # noqa: BLE001 - the slots go back whatever failed; the child is served anyway
            self.pool.free(slots)
            held.tier.release(held.entry)
            return None, self.failed(f"the {entry.n}-token context in the {held.tier.name} tier could not be written "
                                     f"back ({type(exc).__name__}); served by a full prefill")
        held.tier.release(held.entry)  # out of host memory (moved back); the disk keeps its file
        seconds = time.perf_counter() - start
        self.restores[held.tier.name] += 1
        self.restore_seconds[held.tier.name] += seconds
        context = CompactedContext(
            context_ids=entry.context_ids, settings=entry.settings, slots=slots, kept_per_layer=entry.kept_per_layer,
            layout=entry.layout, keep_positions=entry.keep_positions, gdn_snapshot=entry.gdn_snapshot,
            timings={**entry.timings, "restore_s": seconds, "restored_from": held.tier.name},
            prefix_cells=cells, tenant=entry.tenant, reuse_count=entry.reuse_count)
        return context, None

    def failed(self, why: str) -> str:
        """Count and log why a context could not come back; returns ``why``."""
        self.restore_failures += 1
        self.last_restore_failure = why
        logger.warning("sglang_kvx: %s", why)
        return why

    def clear(self) -> None:
        """/flush_cache: every tier emptied, this model's context files included."""
        for tier in self.tiers:
            tier.clear()

    def counts(self) -> dict[str, float]:
        """Per tier: contexts and bytes held, moves in, contexts let go, restores and their seconds (0
        for a tier that is off, so /metrics keeps its names); the disk's files written and refused."""
        out: dict[str, float] = {"restore_failures": self.restore_failures, "restore_waits": self.restore_waits}
        for name in TIER_NAMES:
            tier = next((t for t in self.tiers if t.name == name), None)
            held = (len(tier), tier.nbytes, tier.capacity, tier.dropped) if tier is not None else (0, 0, 0, 0)
            out.update({f"{name}_contexts": held[0], f"{name}_bytes": held[1], f"{name}_capacity_bytes": held[2],
                        f"{name}_contexts_stored": self.moved_in[name], f"{name}_contexts_dropped": held[3],
                        f"{name}_restores": self.restores[name], f"{name}_restore_seconds": self.restore_seconds[name]})
        disk = self.disk
        queued = disk.queue_report() if disk is not None else {}
        out.update({"disk_files_written": disk.written if disk is not None else 0,
                    "disk_write_failures": disk.write_failures if disk is not None else 0,
                    "disk_files_refused": sum(disk.refused.values()) if disk is not None else 0,
                    "disk_writes_queued": queued.get("writes_queued", 0), "disk_reads_queued": queued.get("reads_queued", 0)})
        return out

    def disk_report(self) -> dict:
        """What /kvx/stats says of the disk tier beyond the counts: its directory, refusals by reason."""
        if self.disk is None:
            return {"enabled": False}
        # The directory's name only: a response never carries a machine path.
        return {"enabled": True, "directory_name": self.disk.directory.name, "persist_contexts": self.persist_all,
                "files_refused_by_reason": dict(self.disk.refused), "last_refusal": self.disk.last_refusal,
                "queue": self.disk.queue_report(), "contexts": self.disk.summaries()}
