"""The few views of SGLang's objects that the rest of the package talks to.

``sglang_kvx.adapter`` builds them from SGLang's scheduler, requests and forward batches (it is the
only package that names SGLang); a unit test builds them from plain tensors. Layers are indexed
among the attention layers (0 = the model's first full-attention layer); slots are LongTensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch


class TensorParallel(Protocol):
    """The scheduler's tensor-parallel group (``--tp-size`` > 1): this rank and two collectives.
    Every rank must make the same calls in the same order (the ranks run the same requests in lockstep)."""

    rank: int
    size: int

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape on all ranks), concatenated along ``dim`` in rank order."""
        ...

    def all_agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        ...


class KVPool(Protocol):
    """One scheduler's KV pool, allocator and (on hybrid models) recurrent-state pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_entry: int  # one position's keys and values in one attention layer, all KV heads
    can_fold: bool  # every attention layer's entries share one shape and dtype (compact/layout.py)
    has_state: bool  # GDN / conv states to snapshot and restore (hybrid models)
    total: int  # slots in the pool
    device: torch.device
    dtype: torch.dtype  # the entries' dtype (every attention layer's)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` in attention layer ``layer``: each [len, kv_heads, D], pool dtype."""
        ...

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor: ...

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def layer_id(self, layer: int) -> int:
        """The model's layer index of attention layer ``layer`` (what attention kernels are told)."""
        ...

    def row(self, row: int, length: int) -> torch.Tensor:
        """The slots of a request row's first ``length`` positions."""
        ...

    def alloc(self, count: int) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def room(self) -> int:
        """Slots a waiting request can get now: free ones plus what the prefix cache can evict."""
        ...

    def snapshot_state(self, request: "Request") -> Any: ...

    def state_template(self) -> Any:
        """One state slot's snapshot, as ``snapshot_state`` gives it (its shapes and dtypes are what a
        restored snapshot must have); only where ``has_state``."""
        ...

    def restore_state(self, request: "Request", snapshot: Any) -> None: ...

    def snapshot_rows(self, rows: list[int], rows_on_device: Any = None) -> Any:
        """The recurrent states of request rows (a decode step about to be re-run); ``rows_on_device``: the
        same rows as a device tensor where the caller has one (nothing copied from the host)."""
        ...

    def restore_rows(self, rows: list[int], snapshot: Any, which: list[int] | None = None,
                     index: Any = None) -> None:
        """Put back a snapshot of ``rows``: only the rows at positions ``which`` (all when None); ``index``:
        ``which`` already on the device (built there once for the re-run's sub-batch and this restore)."""
        ...


class Request(Protocol):
    """One request, as admission, recording and compaction see it."""

    rid: str
    input_ids: Sequence[int]
    custom_params: Any
    max_new_tokens: int | None
    has_output: bool
    finished: bool
    aborted: bool
    holds_kv: bool
    row: int  # its row of the request-to-slot table (valid while it holds KV)
    prefix_len: int
    owned_from: int  # positions before this are shared (prefix cache / store) and never freed with it
    owned_len: int  # positions it holds KV for (SGLang frees [owned_from, owned_len) at release)
    # The first prompt position it wants log-probabilities for (None: none of its prompt's); settable.
    input_logprobs_from: int | None
    # Its prefix-cache namespace (SGLang's extra_key, cache_salt; None: neither): contexts never cross it.
    namespace: tuple[str | None, str | None] | None

    @property
    def state(self) -> Any:
        """The extension's per-request state (``serve.request_state.RequestState``), created on first use."""
        ...

    def abort(self, message: str, status: int = 400) -> None:
        """End it with an error (HTTP ``status``: 400 the request's fault, 5xx the server's): refused
        before it runs, or stopped after the current step."""
        ...

    def keep_out_of_tree(self) -> None:
        """Its KV is not inserted in the prefix cache at release (the store or a job holds what it keeps)."""
        ...

    def replace_input_ids(self, ids: Sequence[int]) -> None: ...

    def hide_from_client(self) -> None:
        """An internal request: nothing it produces goes to a client."""
        ...


class RoundBudget(Protocol):
    """The token budget of the prefill batch SGLang is forming (its ``PrefillAdder``), live: what is
    free and evictable now less what the requests it admitted this round and the running ones will take."""

    def room(self) -> int: ...


@dataclass(frozen=True)
class Segment:
    """One request row's tokens in a forward batch."""

    index: int  # position in the batch
    row: int
    start: int  # first token in the batch's flat token dimension
    length: int
    prefix_len: int  # tokens of that request already in the cache (its first token's position)


class Batch(Protocol):
    """A forward batch: which rows it runs and where their tokens are."""

    is_extend: bool
    is_decode: bool

    @property
    def rows(self) -> list[int]: ...

    @property
    def segments(self) -> list[Segment]: ...
