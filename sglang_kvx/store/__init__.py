"""The compacted-context store: what each compacted context keeps, and where.

A compacted context holds S slots of SGLang's own KV pool ("rank slots"): in
attention layer l and KV head h, slot i holds that head's i-th kept entry (keys
are cached after RoPE, so a slot need not mean one position across heads). With
per-layer budgets the layers are folded (``compact/layout.py``): S is the mean of
the K_l, and a layer keeping more than S puts its last ranks in cells another
layer leaves empty. The slots are allocated from SGLang's allocator, so the
pool's free count sees them, and the rest of the context's slots go back to the
pool. GDN states at the end of the
context are kept as a snapshot and restored into every child's state slot.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from sglang_kvx.compact.layout import PrefixLayout
from sglang_kvx.settings import CompactionSettings


class PrefixCells(NamedTuple):
    """What one layer reads of a compacted prefix, where that differs from the row's first S slots."""

    num_slots: int  # S: the prefix's slots at the start of the row
    own: int  # this layer's ranks in its own buffer: row slots [0, own); [own, S) are masked out
    borrowed: tuple[tuple[int, torch.Tensor], ...] = ()  # (layer_id of a buffer, slots there): its further ranks
    # Per-head budgets: each KV head's own count (``own`` is then their minimum) and its further ranks,
    # as (layer_id of a buffer, KV head there, slots there); ``borrowed`` is then empty.
    head_own: tuple[int, ...] | None = None
    head_borrowed: tuple[tuple[tuple[int, int, torch.Tensor], ...], ...] | None = None


@dataclass
class CompactedContext:
    context_ids: tuple[int, ...]
    settings: CompactionSettings
    slots: torch.Tensor  # LongTensor [S]: pool slots holding the kept entries (rank order)
    kept_per_layer: list[int]
    layout: PrefixLayout  # which cells of which layer's buffer hold each layer's ranks
    keep_positions: list[torch.Tensor | list[torch.Tensor]] = field(default_factory=list)  # per layer [kv_heads, K_l] (per-head budgets: a list of [K_lh])
    gdn_snapshot: Any = None  # the parent's recurrent states (KVPool.snapshot_state), or None
    timings: dict[str, float] = field(default_factory=dict)
    # Per attention layer, what attention reads beyond the backend's plain row (None: plain).
    prefix_cells: list[PrefixCells | None] = field(default_factory=list)
    tenant: str | None = None  # the parent's custom_params.kvx.tenant (None: the shared, untagged one)
    reuse_count: int = 0
    active_children: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def n(self) -> int:
        return len(self.context_ids)

    @functools.cached_property
    def keep_positions_lists(self) -> list[list[list[int]]]:
        """``keep_positions`` as plain lists, converted once (every stats call ships them)."""
        return [[h.tolist() for h in p] if isinstance(p, list) else p.tolist() for p in self.keep_positions]

    @property
    def num_slots(self) -> int:
        return int(self.slots.numel())

    @property
    def per_head(self) -> bool:
        """Whether its KV heads keep different counts (a per-head layout)."""
        return self.layout.per_head

    @functools.cached_property
    def needs_masked_attention(self) -> bool:
        """Whether some layer reads other than exactly its S slots (it masks ranks or borrows cells)."""
        return not self.layout.is_all_plain

    def summary(self) -> dict[str, Any]:
        return {
            "context_tokens": self.n,
            "kept_entries": self.kept_per_layer,
            "slots": self.num_slots,
            "folded_entries": self.layout.borrowed_entries,  # ranks kept in another layer's empty cells
            "policy": self.settings.policy,
            "keep_fraction": self.settings.keep_fraction,
            "protected_prefix_len": self.settings.protected_prefix_len,
            "allocation": self.settings.allocation,
            "salted": self.settings.namespace is not None,  # whether it lives in a namespace (never the salt itself)
            "tenant": self.tenant,
            "reuse_count": self.reuse_count,
            "active_children": self.active_children,
            "timings": self.timings,
        }


def longest_extended(entries, prompt_ids, settings: CompactionSettings):
    """The longest of ``entries`` (each with ``context_ids``, ``n`` and ``settings``: a stored context
    or one held in a tier) with ``settings`` that the prompt strictly extends; None when none does."""
    best = None
    for entry in entries:
        n = entry.n
        if (entry.settings == settings and n < len(prompt_ids) and (best is None or n > best.n)
                and tuple(prompt_ids[:n]) == entry.context_ids):
            best = entry
    return best


@dataclass
class ContextStore:
    """Compacted contexts keyed by (token ids, settings); a prompt adopts the longest stored prefix.

    The same context compacted by two policies (or two budgets) is two entries: an
    evaluation scores every method on the same parent.
    """

    contexts: dict[tuple, CompactedContext] = field(default_factory=dict)
    # Called with each context as it is stored (the disk tier's --kvx-persist-contexts writes it).
    on_add: list[Callable[[CompactedContext], None]] = field(default_factory=list)
    added: int = 0  # contexts stored so far (compactions done)
    entries_freed: int = 0  # context entries the stored contexts did not keep (n - S each)

    def __len__(self) -> int:
        return len(self.contexts)

    @staticmethod
    def key_of(context_ids, settings: CompactionSettings) -> tuple:
        return (tuple(int(t) for t in context_ids), settings)

    def get(self, context_ids, settings: CompactionSettings) -> CompactedContext | None:
        return self.contexts.get(self.key_of(context_ids, settings))

    def add(self, context: CompactedContext, compacted: bool = True) -> None:
        """Store ``context``: just compacted, or (``compacted=False``) restored from a tier below."""
        key = self.key_of(context.context_ids, context.settings)
        if key in self.contexts:
            raise ValueError("context already compacted with these settings")
        self.contexts[key] = context
        if compacted:
            self.added += 1
            self.entries_freed += context.n - context.num_slots
        for listener in self.on_add:
            listener(context)

    def longest_prefix_of(self, prompt_ids, settings: CompactionSettings) -> CompactedContext | None:
        """The longest context stored with ``settings`` that the prompt strictly extends."""
        return longest_extended(self.contexts.values(), prompt_ids, settings)

    def remove(self, context: CompactedContext) -> None:
        del self.contexts[self.key_of(context.context_ids, context.settings)]

    def slots_held(self) -> int:
        return sum(c.num_slots for c in self.contexts.values())
