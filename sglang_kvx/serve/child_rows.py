"""Which request rows read a compacted prefix, and what attention needs to know of them.

A child takes a row of SGLang's request-to-token table when its prefill is allocated (``place``):
its first S positions are the context's rank slots, its own tokens keep their true positions (the
row's offset n - S), and on a hybrid model its recurrent state starts from the parent's snapshot.
Attention asks, per forward batch, which of its rows read a compacted prefix and how.
"""

from __future__ import annotations

import torch

from sglang_kvx.ports import Batch, KVPool, Request
from sglang_kvx.store import CompactedContext, PrefixCells


class ChildRows:
    def __init__(self, pool: KVPool, num_rows: int) -> None:
        self.pool = pool
        self.row_context: dict[int, CompactedContext] = {}  # request row -> the compacted prefix it reads
        # True-position offset of each request row's tokens (n - S for a child, else 0).
        self.position_offset = torch.zeros(num_rows, dtype=torch.int64, device=pool.device)

    @staticmethod
    def prefix_slots(request: Request) -> torch.Tensor | None:
        """The pool slots a child's cached prefix is (None: not a child)."""
        state = request.state
        context = state.context if state is not None else None
        return None if context is None else context.slots[: request.prefix_len]

    def place(self, request: Request) -> CompactedContext | None:
        """Its row is assigned: record the row's position offset; a child's recurrent state starts from
        the parent's snapshot. Returns the context a child reads (None for others)."""
        row = request.row
        state = request.state
        context = state.context if state is not None else None
        if context is None:
            self.row_context.pop(row, None)
            self.position_offset[row] = 0
            return None
        self.position_offset[row] = context.n - context.num_slots
        self.row_context[row] = context
        if context.gdn_snapshot is not None and request.prefix_len == context.num_slots:
            self.pool.restore_state(request, context.gdn_snapshot)
        return context

    def release(self, request: Request) -> None:
        context = request.state.context
        if request.finished:
            context.active_children -= 1
        if request.holds_kv:
            self.position_offset[request.row] = 0
            self.row_context.pop(request.row, None)

    @property
    def any_offsets(self) -> bool:
        """Whether some running row reads a compacted prefix (positions to shift); no device sync."""
        return bool(self.row_context)

    def masked_rows(self, layer: int, batch: Batch) -> dict[int, PrefixCells]:
        """Batch index -> PrefixCells for each row reading a compacted prefix that attention layer
        ``layer`` reads other than as its S slots (masked ranks, borrowed cells). Looks at the
        batch's rows only while a child of such a context runs."""
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return {}
        found = {}
        for i, row in enumerate(batch.rows):
            context = self.row_context.get(row)
            if context is not None and context.prefix_cells[layer] is not None:
                found[i] = context.prefix_cells[layer]
        return found

    def child_contexts(self, layer: int, batch: Batch) -> dict[int, tuple[CompactedContext, PrefixCells | None]]:
        """Batch index -> (the compacted context the row reads, its cells in attention layer ``layer``)."""
        if not self.row_context:
            return {}
        found = {}
        for i, row in enumerate(batch.rows):
            context = self.row_context.get(row)
            if context is not None:
                found[i] = (context, context.prefix_cells[layer] if context.prefix_cells else None)
        return found

    def needs_per_layer_lengths(self, batch: Batch) -> bool:
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return False
        return any(self.row_context[row].needs_masked_attention for row in batch.rows if row in self.row_context)

    def clear(self) -> None:
        self.row_context.clear()
        self.position_offset.zero_()
