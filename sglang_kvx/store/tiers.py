"""Tiers below the KV pool: where a compacted context goes when the pool gives it up.

A compacted context is small (p of its entries), so dropping it when the pool needs room throws
away a prefill and a compaction that are cheap to keep elsewhere. A tier holds *copies* of evicted
contexts (``TieredContext``: the kept keys and values of every attention layer over the context's
S slots, in its folded layout, plus everything ``CompactedContext`` needs to be rebuilt) and gives
one back when a child asks for it. Tiers know nothing of the pool: moving bytes in and out of it is
``serve/tiering.py``'s work.

``ContextTier`` is the small interface a tier implements; ``HostTier`` is host memory, bounded in
bytes; ``store/disk.py``'s ``DiskTier`` is files in a directory and takes what the host tier drops
(``put`` returns it).
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sglang_kvx.compact.layout import PrefixLayout
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.signals.recorder import tensor_bytes
from sglang_kvx.store import PrefixCells, longest_extended


@dataclass
class TieredContext:
    """A compacted context outside the pool: its kept entries as the pool held them (per attention
    layer, that layer's buffer over the context's S slots, borrowed cells included) and what is
    needed to serve children from them again."""

    context_ids: tuple[int, ...]
    settings: CompactionSettings
    kept_per_layer: list[int]
    layout: PrefixLayout
    keys: list[torch.Tensor]  # per attention layer [S, kv_heads, D], the pool's dtype, on the host
    values: list[torch.Tensor]
    prefix_cells: list[PrefixCells | None]  # as in the pool; slots re-pointed at restore (``serve/tiering.py``)
    keep_positions: list = field(default_factory=list)
    gdn_snapshot: Any = None  # already a host copy (``KVPool.snapshot_state``)
    timings: dict[str, float] = field(default_factory=dict)
    tenant: str | None = None
    reuse_count: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def n(self) -> int:
        return len(self.context_ids)

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def per_head(self) -> bool:
        return self.layout.per_head

    @property
    def key(self) -> tuple:
        return (self.context_ids, self.settings)

    @functools.cached_property
    def nbytes(self) -> int:
        """What holding it costs: the kept entries and the recurrent-state snapshot."""
        return tensor_bytes(self.keys) + tensor_bytes(self.values) + tensor_bytes(self.gdn_snapshot)


class ContextTier(Protocol):
    """One tier of the store below the pool (host memory, disk)."""

    name: str  # what a restored child's meta_info["kvx"]["restored_from"] says
    capacity: int  # bytes it may hold
    nbytes: int  # bytes it holds
    dropped: int  # entries it let go for room, or could never hold

    def put(self, entry: TieredContext) -> list[TieredContext]:
        """Hold ``entry`` (replacing an entry of the same key); returns the entries it let go to make
        room -- ``entry`` itself when it can never fit -- for a tier below to take."""
        ...

    def holds_any(self) -> bool: ...

    def longest_prefix_of(self, prompt_ids, settings: CompactionSettings) -> Any:
        """The longest entry held with ``settings`` that the prompt strictly extends (None: none); it
        has ``n``, its token count, ``settings`` and ``per_head``."""
        ...

    def fetch(self, entry: Any) -> TieredContext | str | None:
        """``entry`` (from ``longest_prefix_of``) as a whole context in host memory; why it cannot come
        back; or None while it is being read (the disk tier's worker)."""
        ...

    def release(self, entry: Any) -> None:
        """``entry``'s context went back into the pool (or cannot): a tier that moves it (host memory)
        stops holding it, one that copies it (disk) keeps it."""
        ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


class HostTier:
    """Contexts in host memory (pinned where CUDA is present, see ``serve/tiering.py``), at most
    ``capacity`` bytes. Room is made least recently used first, but a tenant holding more than an
    even share of the tier gives up its own entries before anyone else's: one tenant's flood of
    parents cannot push every other tenant's contexts out (the pool's reserve does the same)."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple, TieredContext] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.dropped = 0  # entries let go to make room (or too large to hold at all)

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, entry: TieredContext) -> list[TieredContext]:
        old = self.entries.pop(entry.key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        size = entry.nbytes
        if size > self.capacity:
            self.dropped += 1
            return [entry]
        let_go = []
        while self.nbytes + size > self.capacity:
            victim = self._victim()
            self._remove(victim)
            let_go.append(victim)
        self.entries[entry.key] = entry
        self.nbytes += size
        self.dropped += len(let_go)
        return let_go

    def _victim(self) -> TieredContext:
        """The least recently used entry of a tenant over its even share, else the least recently used."""
        held: dict[str | None, int] = {}
        for entry in self.entries.values():
            held[entry.tenant] = held.get(entry.tenant, 0) + entry.nbytes
        share = self.capacity / max(1, len(held))
        over = [e for e in self.entries.values() if held[e.tenant] > share]
        return min(over or self.entries.values(), key=lambda e: e.last_used)

    def longest_prefix_of(self, prompt_ids, settings: CompactionSettings) -> TieredContext | None:
        return longest_extended(self.entries.values(), prompt_ids, settings)

    def holds_any(self) -> bool:
        return bool(self.entries)

    def fetch(self, entry: TieredContext) -> TieredContext:
        return entry  # in memory already (held or, if let go meanwhile, still this object)

    def release(self, entry: TieredContext) -> None:
        if self.entries.get(entry.key) is entry:
            self._remove(entry)

    def _remove(self, entry: TieredContext) -> None:
        del self.entries[entry.key]
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def summaries(self) -> list[dict[str, Any]]:
        """What /kvx/stats lists of each held context."""
        return [{"context_tokens": e.n, "slots": e.num_slots, "bytes": e.nbytes, "policy": e.settings.policy,
                 "keep_fraction": e.settings.keep_fraction, "salted": e.settings.namespace is not None,
                 "tenant": e.tenant} for e in self.entries.values()]
