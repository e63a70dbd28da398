"""Compaction of one prefilled context: read -> score -> allocate -> select -> fold -> gather -> store.

Works on a ``KVPool`` view only. The context's keys are read from the pool one attention layer at
a time, when the policy asks for them (``ContextSignals.keys[layer]``); values are never read for
scoring. Gathering then reads each layer's kept entries at the pool's dtype, all layers before any
write, so the rank slots may be the context's own first S slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch

from sglang_kvx.compact.layout import PrefixLayout, fold_heads, fold_layers
from sglang_kvx.ops.compaction import compact_gather
from sglang_kvx.policies import KVPolicy
from sglang_kvx.ports import KVPool
from sglang_kvx.select import KeepSet, choose_keep_set
from sglang_kvx.settings import CompactionSettings
from sglang_kvx.signals import ContextSignals
from sglang_kvx.store import CompactedContext, PrefixCells

logger = logging.getLogger(__name__)


class NothingFreed(Exception):
    """Rounded up to whole pages, the kept entries would fill as many slots as the whole context."""


class PoolLayers(Sequence):
    """Per attention layer, the context's keys (or values) as [kv_heads, n, D] float32, read from the
    pool when indexed: a policy that never reads them costs nothing, one that does holds one layer."""

    def __init__(self, read: Callable[[int, torch.Tensor], torch.Tensor], slots: torch.Tensor, num_layers: int) -> None:
        self._read, self._slots, self._num_layers = read, slots, num_layers

    def __len__(self) -> int:
        return self._num_layers

    def __getitem__(self, layer):  # type: ignore[override]
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._num_layers))]
        if not -self._num_layers <= layer < self._num_layers:
            raise IndexError(layer)
        return self._read(layer % self._num_layers, self._slots).transpose(0, 1).float()


class Compactor:
    """Compacts contexts held in one scheduler's pool into ``CompactedContext`` records."""

    def __init__(self, pool: KVPool, policy_of: Callable[[str], KVPolicy], num_q_heads: int,
                 attention_layer_ids: list[int], gdn_layer_ids: list[int], per_layer_lengths: bool,
                 page_size: int = 1) -> None:
        self.pool = pool
        self.policy_of = policy_of
        self.num_q_heads = num_q_heads
        self.attention_layer_ids = attention_layer_ids
        self.layer_index = {layer_id: i for i, layer_id in enumerate(attention_layer_ids)}  # model layer -> attention layer
        self.gdn_layer_ids = gdn_layer_ids
        # Layers lend each other empty cells only when attention can read per-layer lengths and
        # every layer's entries have one shape and dtype.
        self.fold = per_layer_lengths and pool.can_fold
        # SGLang's pool pages (--page-size): a compacted context fills whole pages, so children
        # continue on pages of their own.
        self.page_size = page_size

    def read_signals(self, slots: torch.Tensor, protected: int) -> ContextSignals:
        """The context in ``slots``: keys (and values) per attention layer, read lazily."""
        pool = self.pool
        return ContextSignals(
            n=len(slots), num_q_heads=self.num_q_heads, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
            keys=PoolLayers(pool.read_keys, slots, pool.num_layers),
            values=PoolLayers(lambda layer, s: pool.read(layer, s)[1], slots, pool.num_layers),
            protected_prefix_len=protected, device=pool.device,
        )

    def choose(self, signals: ContextSignals, settings: CompactionSettings) -> tuple[KeepSet, PrefixLayout]:
        keep = choose_keep_set(self.policy_of(settings.policy), signals, settings.keep_fraction, settings.allocation,
                               page_size=self.page_size, fold=self.fold)
        layout = fold_heads(keep.kept_per_head) if keep.per_head else fold_layers(keep.kept_per_layer, fold=self.fold)
        if layout.num_slots % self.page_size:
            raise NothingFreed(f"with --page-size {self.page_size} the kept entries fill as many pages as the whole "
                               f"{signals.n}-token context; nothing would be freed")
        return keep, layout

    def gather_kept(self, context_slots: torch.Tensor, slots: torch.Tensor, keep: KeepSet, layout: PrefixLayout) -> None:
        """Copy each (layer, KV head)'s kept entries, in rank order, into ``slots`` as ``layout`` places
        them. Every kept entry is read before anything is written: ``slots`` may overlap the context's."""
        if layout.per_head:
            return self._gather_kept_per_head(context_slots, slots, keep, layout)
        kept = []
        for layer in range(self.pool.num_layers):
            positions = keep.positions[layer].to(context_slots.device)  # [kv_heads, K_l]
            # Read only the positions some head keeps (pool dtype), then each head's own from those.
            needed = positions.unique()  # sorted
            keys, values = self.pool.read(layer, context_slots[needed])  # [U, kv_heads, D]
            local = torch.searchsorted(needed, positions)
            kept.append((compact_gather(keys.transpose(0, 1), local).transpose(0, 1),
                         compact_gather(values.transpose(0, 1), local).transpose(0, 1)))
        for layer, (keys, values) in enumerate(kept):
            cells = layout.layers[layer]
            rank = 0
            for holder, start, end in [(layer, 0, cells.own)] + [(b.layer, b.start, b.end) for b in cells.borrowed]:
                self.pool.write(holder, slots[start:end], keys[rank : rank + end - start], values[rank : rank + end - start])
                rank += end - start

    def _gather_kept_per_head(self, context_slots: torch.Tensor, slots: torch.Tensor, keep: KeepSet,
                              layout: PrefixLayout) -> None:
        """Per-head layouts: each layer's S cells are composed whole (every head's own ranks and the
        ranks other (layer, head)s lend it), then written once per layer; unused cells hold zeros."""
        images = []
        for layer in range(self.pool.num_layers):
            keys, values = self.pool.read(layer, slots[:0])  # the pool's entry shape and dtype
            images.append((keys.new_zeros((layout.num_slots, *keys.shape[1:])),
                           values.new_zeros((layout.num_slots, *values.shape[1:]))))
        for layer in range(self.pool.num_layers):
            for head, positions in enumerate(keep.head_positions(layer)):
                keys, values = self.pool.read(layer, context_slots[positions.to(context_slots.device)])
                cells = layout.heads[layer][head]
                rank = 0
                for holder, holder_head, start, end in [(layer, head, 0, cells.own)] + [
                        (b.layer, b.head, b.start, b.end) for b in cells.borrowed]:
                    images[holder][0][start:end, holder_head] = keys[rank : rank + end - start, head]
                    images[holder][1][start:end, holder_head] = values[rank : rank + end - start, head]
                    rank += end - start
        for layer, (keys, values) in enumerate(images):
            self.pool.write(layer, slots[: layout.num_slots], keys, values)

    def prefix_cells(self, slots: torch.Tensor, layout: PrefixLayout) -> list[PrefixCells | None]:
        """Per attention layer, what its attention reads of the context beyond the plain S slots (None: plain)."""
        if layout.per_head:
            return [None if layout.is_plain(layer) else PrefixCells(
                layout.num_slots, min(c.own for c in heads), (), tuple(c.own for c in heads),
                tuple(tuple((self.pool.layer_id(b.layer), b.head, slots[b.start : b.end]) for b in c.borrowed) for c in heads))
                for layer, heads in enumerate(layout.heads)]
        cells: list[PrefixCells | None] = []
        for layer, layer_cells in enumerate(layout.layers):
            if layout.is_plain(layer):
                cells.append(None)
                continue
            borrowed = tuple((self.pool.layer_id(b.layer), slots[b.start : b.end]) for b in layer_cells.borrowed)
            cells.append(PrefixCells(layout.num_slots, layer_cells.own, borrowed))
        return cells

    def compact(self, context_ids: tuple[int, ...], context_slots: torch.Tensor, settings: CompactionSettings,
                take_slots: Callable[[int], torch.Tensor | None], fill_signals: Callable[[ContextSignals], None],
                gdn_snapshot: Any, timings: dict[str, float]) -> CompactedContext | None:
        """Compact the context held in ``context_slots``. ``take_slots(S)`` gives the S rank slots (None:
        no room, the context stays as it is); ``fill_signals`` adds what was recorded or computed beside
        the pool (captures, KVzip's reconstruction attention)."""
        t0 = time.perf_counter()
        signals = self.read_signals(context_slots, settings.protected_prefix_len)
        fill_signals(signals)
        t1 = time.perf_counter()
        keep, layout = self.choose(signals, settings)
        t2 = time.perf_counter()
        slots = take_slots(layout.num_slots)
        if slots is None:
            logger.warning("sglang_kvx: no room for %d compacted slots; the %d-token context stays uncompacted",
                           layout.num_slots, len(context_ids))
            return None
        self.gather_kept(context_slots, slots, keep, layout)
        context = CompactedContext(
            context_ids=context_ids, settings=settings, slots=slots, kept_per_layer=keep.kept_per_layer,
            layout=layout, prefix_cells=self.prefix_cells(slots, layout),
            keep_positions=[[h.cpu() for h in p] if isinstance(p, list) else p.cpu() for p in keep.positions],
            gdn_snapshot=gdn_snapshot,
            timings={
                **timings,
                "signals_s": t1 - t0,  # assembling what was recorded (keys are read per layer while scoring)
                "score_select_s": t2 - t1,  # policy scores, layer budgets, per-head top-K
                "compact_s": time.perf_counter() - t2,  # rank-slot copy
                "bytes_moved": sum(map(sum, keep.kept_per_head)) * self.pool.bytes_per_entry // self.pool.num_kv_heads,
            },
        )
        logger.info("sglang_kvx: compacted %d-token context with %s (p=%g): kept %s entries per attention layer",
                    context.n, settings.policy, settings.keep_fraction, keep.kept_per_layer)
        return context
