"""How hooks find their scheduler's runtime: a link on the objects they are handed, not a global.

At scheduler start the plugin puts one ``Link`` on the scheduler's request-to-token pool, on every
attention and linear-attention layer of the model and on its attention backends. Forward batches
are copied by SGLang between building and running, so nothing rides on them; instead the link
keeps the view of the batch it last saw, built where SGLang builds the forward batch from the
scheduler's (``begin``: its rows as host lists), so no layer reads them back from the device.
"""

from __future__ import annotations

from typing import Any

from sglang_kvx.adapter.views import SGLangBatch
from sglang_kvx.ops.flashinfer_plans import DecodePlans
from sglang_kvx.serve.page_tables import TableCarry

LINK_ATTR = "_kvx_link"


class Link:
    """A scheduler's runtime, as its hooks reach it."""

    __slots__ = ("runtime", "metrics", "kernel_plans", "graph_declines", "host_syncs", "host_sync_forwards",
                 "masked_attention_calls", "table_carry", "_batch")

    def __init__(self, runtime, metrics=None) -> None:
        self.runtime = runtime
        self.metrics = metrics  # adapter.metrics.KvxMetrics with --enable-metrics, else None
        self.kernel_plans = DecodePlans()  # FlashInfer wrappers: planned once per forward batch, run per layer
        self.graph_declines: dict[str, int] = {}  # batches kept off a captured graph, by reason (/kvx/stats)
        # Under SGLANG_KVX_COUNT_HOST_SYNCS=1: per forward mode and batch size, the last forward's host syncs
        # by kind (ops/host_syncs.py); None otherwise (nothing counted, nothing slowed).
        self.host_syncs: dict[str, dict[str, int]] | None = None
        self.host_sync_forwards = 0  # forwards counted so far
        # Layer calls that read a compacted prefix or a decode step's span through masked attention instead of
        # the backend's own kernels (issue #56 counts them; /kvx/stats).
        self.masked_attention_calls = 0
        self.table_carry = TableCarry()  # a decode batch's page tables, kept for its next step
        self._batch: SGLangBatch | None = None

    def begin(self, forward_batch: Any, rows: list[int]) -> SGLangBatch:
        """A forward batch was built from the scheduler's batch, whose rows are ``rows`` (host ints)."""
        self._batch = SGLangBatch(forward_batch, rows)
        self.kernel_plans.begin_batch()
        return self._batch

    def batch(self, forward_batch: Any) -> SGLangBatch:
        """The view of ``forward_batch`` (or of SGLang's copy of it into its runner's buffers)."""
        view = self._batch
        if view is None or not view.serves(forward_batch):
            view = self._batch = SGLangBatch(forward_batch)
            self.kernel_plans.begin_batch()
        return view


def link_of(holder: Any) -> Link | None:
    """The link on a pool, layer or backend (None: the extension is not active in this process)."""
    return getattr(holder, LINK_ATTR, None)


def runtime_of(holder: Any):
    link = link_of(holder)
    return link.runtime if link is not None else None


def attach(holder: Any, link: Link) -> None:
    # object.__setattr__: some SGLang modules (torch.nn.Module) route attribute writes through their own __setattr__.
    object.__setattr__(holder, LINK_ATTR, link)
