"""The ``ports`` views built from SGLang's objects: its pools, a ``Req``, a ``ForwardBatch``.

Every SGLang field the runtime reads or writes is named here and nowhere else outside the adapter.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from sglang_kvx.ops.host_syncs import device_positions, host_values
from sglang_kvx.ports import Segment

STATE_ATTR = "_kvx_state"  # on a Req: its serve.request_state.RequestState


class SGLangTensorParallel:
    """The scheduler's tensor-parallel group (SGLang's ``get_tp_group()``), as ``ports.TensorParallel``.
    CPU tensors go over the group's gloo ``cpu_group`` (SGLang's CPU all-gather wants sgl-kernel's
    shared-memory op, which PyPI wheels lack); device tensors over its device group."""

    def __init__(self) -> None:
        from sglang.srt.distributed import get_tp_group

        self._group = get_tp_group()
        self.rank = int(self._group.rank_in_group)
        self.size = int(self._group.world_size)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if not tensor.is_cpu:
            return self._group.all_gather(tensor, dim)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(parts, tensor, group=self._group.cpu_group)
        return torch.cat(parts, dim=dim)

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self._group.cpu_group)
        return bool(flag.item())


class SGLangKVPool:
    """One scheduler's KV pool (by attention-layer index), token allocator, prefix cache and state pool."""

    def __init__(self, scheduler, attention_layer_ids: list[int]) -> None:
        runner = scheduler.tp_worker.model_runner
        self._kv = runner.token_to_kv_pool
        self._allocator = scheduler.token_to_kv_pool_allocator
        self._tree = scheduler.tree_cache
        self._req_to_token = scheduler.req_to_token_pool.req_to_token
        self._req_to_token_pool = scheduler.req_to_token_pool
        self._state_pool = getattr(scheduler.req_to_token_pool, "mamba_pool", None)
        self._layer_ids = list(attention_layer_ids)
        self.num_layers = len(self._layer_ids)
        first = self._kv.get_key_buffer(self._layer_ids[0])
        self.num_kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[2])
        self.device = first.device
        self.dtype = first.dtype
        self.bytes_per_entry = 2 * self.num_kv_heads * self.head_dim * first.element_size()
        self.has_state = self._state_pool is not None
        self.total = int(scheduler.max_total_num_tokens)

        def kinds(buffer_of) -> set:
            return {(tuple(buffer_of(i).shape[1:]), buffer_of(i).dtype, buffer_of(i).device) for i in self._layer_ids}

        self.can_fold = len(kinds(self._kv.get_key_buffer)) == 1 and len(kinds(self._kv.get_value_buffer)) == 1

    def layer_id(self, layer: int) -> int:
        return self._layer_ids[layer]

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self._kv.get_key_buffer(self._layer_ids[layer])[slots]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer_id = self._layer_ids[layer]
        return self._kv.get_key_buffer(layer_id)[slots], self._kv.get_value_buffer(layer_id)[slots]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        layer_id = self._layer_ids[layer]
        self._kv.get_key_buffer(layer_id)[slots] = keys
        self._kv.get_value_buffer(layer_id)[slots] = values

    def row(self, row: int, length: int) -> torch.Tensor:
        return self._req_to_token[row, :length].to(torch.long)

    def alloc(self, count: int) -> torch.Tensor | None:
        if self._allocator.available_size() < count:
            self._make_room(count)
        slots = self._allocator.alloc(count)
        return None if slots is None else slots.to(torch.long)

    def _make_room(self, count: int) -> None:
        """Evict idle radix-tree entries, as SGLang does before its own allocations (with chunked
        prefill a parent's earlier chunks sit in the tree, so compacting it can need fresh slots).
        While SGLang releases finished requests it batches frees in a group that counts only once
        it ends: the group is ended and begun again so the evicted slots can be taken now."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(self._tree, count)
        if self._allocator.free_group is not None:
            self._allocator.free_group_end()
            self._allocator.free_group_begin()

    def free(self, slots: torch.Tensor) -> None:
        self._allocator.free(slots)

    def room(self) -> int:
        return int(self._allocator.available_size() + self._tree.evictable_size())

    def _state_slot(self, request: "SGLangRequest") -> torch.Tensor:
        index = request.req.kv.mamba_pool_idx.reshape(1).to(torch.long)
        translate = getattr(self._req_to_token_pool, "translate_mamba_indices", None)
        return translate(index) if translate is not None else index

    def _state_slots_of_rows(self, rows: list[int], rows_on_device: torch.Tensor | None = None) -> torch.Tensor:
        if rows_on_device is None:
            rows_on_device = torch.tensor(rows, dtype=torch.long, device=self.device)
        index = self._req_to_token_pool.get_mamba_indices(rows_on_device.to(device=self.device, dtype=torch.long))
        translate = getattr(self._req_to_token_pool, "translate_mamba_indices", None)
        return translate(index.to(torch.long)) if translate is not None else index.to(torch.long)

    def _state_tensors(self) -> list[torch.Tensor]:
        cache = self._state_pool.mamba_cache
        return [*cache.conv, cache.temporal]  # each [mamba layers, slots, ...]

    def snapshot_rows(self, rows: list[int], rows_on_device: torch.Tensor | None = None) -> Any:
        """The recurrent states of request rows ``rows`` (to re-run a decode step from them), copied
        on the pool's device by the kernel layer's snapshot op. ``rows_on_device``: the same rows already
        on the device (a batch's ``req_pool_indices``), so nothing is copied from the host."""
        from sglang_kvx.ops.state_snapshot import snapshot_states

        slots = self._state_slots_of_rows(rows, rows_on_device)  # kept with the copy: its restore puts it back
        if self._state_pool._slot_siblings:  # states beside conv / temporal: SGLang's own (host) copy
            return ("host", self._state_pool.get_cpu_copy(slots), slots)
        # The slots are SGLang's own mapping's: checked by the device, not read back.
        return ("device", snapshot_states(self._state_tensors(), slots, slot_dim=1, bounds="device"), slots)

    def restore_rows(self, rows: list[int], snapshot: Any, which: list[int] | None = None,
                     index: torch.Tensor | None = None) -> None:
        """Put back the snapshot of ``rows``; only the rows at positions ``which`` (all when None; ``index``:
        ``which`` on the device). Its slots are the snapshot's, bound-checked when it was taken."""
        from sglang_kvx.ops.state_snapshot import restore_states

        where, copy, slots = snapshot
        if which is not None and len(which) < len(rows):
            if where == "host":
                raise NotImplementedError("restoring some rows of a host-side state snapshot")
            if index is None:
                index = device_positions(which, copy[0].device)
            index = index.to(copy[0].device)
            copy = [c.index_select(1, index) for c in copy]
            slots = slots.index_select(0, index.to(slots.device))
        if where == "host":
            self._state_pool.load_cpu_copy(copy, slots)
        else:
            restore_states(self._state_tensors(), slots, copy, slot_dim=1, bounds_checked=True)

    @property
    def restores_some_rows(self) -> bool:
        """Whether ``restore_rows`` can put back some rows of a snapshot and leave the others."""
        return not self._state_pool._slot_siblings

    def snapshot_state(self, request: "SGLangRequest") -> Any:
        return self._state_pool.get_cpu_copy(self._state_slot(request))

    def state_template(self) -> Any:
        return self._state_pool.get_cpu_copy(torch.zeros(1, dtype=torch.long, device=self.device))

    def restore_state(self, request: "SGLangRequest", snapshot: Any) -> None:
        self._state_pool.load_cpu_copy(snapshot, self._state_slot(request))
        # SGLang zeroes a fresh request's state slot later in the same prepare step (a deferred
        # clear); this slot now holds the parent's state instead.
        request.req.kv.mamba_needs_clear = False


class SGLangRequest:
    """A ``Req`` as the runtime sees it (built per call: it holds nothing but the Req)."""

    __slots__ = ("req",)

    def __init__(self, req) -> None:
        self.req = req

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def input_ids(self) -> Sequence[int]:
        return self.req.origin_input_ids

    @property
    def custom_params(self) -> Any:
        return getattr(self.req.sampling_params, "custom_params", None)

    @property
    def max_new_tokens(self) -> int | None:
        return self.req.sampling_params.max_new_tokens

    @property
    def namespace(self) -> tuple[str | None, str | None] | None:
        extra_key, cache_salt = getattr(self.req, "extra_key", None), getattr(self.req, "cache_salt", None)
        return None if extra_key is None and cache_salt is None else (extra_key, cache_salt)

    @property
    def has_output(self) -> bool:
        return bool(self.req.output_ids)

    @property
    def finished(self) -> bool:
        return self.req.finished()

    @property
    def aborted(self) -> bool:
        reasons = (getattr(self.req, "finished_reason", None), self.req.to_finish)
        return any(reason is not None and type(reason).__name__ == "FINISH_ABORT" for reason in reasons)

    @property
    def holds_kv(self) -> bool:
        return self.req.kv.holds_kv

    @property
    def row(self) -> int:
        return int(self.req.kv.req_pool_idx)

    @property
    def prefix_len(self) -> int:
        return int(self.req.prefix_len)

    @property
    def input_logprobs_from(self) -> int | None:
        """``logprob_start_len`` when the request returns log-probabilities of its prompt (SGLang's -1:
        only the output's)."""
        start = getattr(self.req, "logprob_start_len", -1)
        return int(start) if self.req.return_logprob and start is not None and start >= 0 else None

    @input_logprobs_from.setter
    def input_logprobs_from(self, value: int) -> None:
        self.req.logprob_start_len = value

    @property
    def owned_len(self) -> int:
        """Positions of its row it holds KV for (what SGLang frees past ``owned_from`` at release)."""
        return int(self.req.owned_kv_len())

    @property
    def owned_from(self) -> int:
        return int(self.req.kv.cache_protected_len)

    @owned_from.setter
    def owned_from(self, value: int) -> None:
        self.req.kv.cache_protected_len = value  # SGLang frees only what lies past it

    @property
    def state(self) -> Any:
        return getattr(self.req, STATE_ATTR, None)

    @state.setter
    def state(self, value: Any) -> None:
        setattr(self.req, STATE_ATTR, value)

    def abort(self, message: str, status: int = 400) -> None:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        if self.req.output_ids:
            # Running: SGLang's own abort of a running request (it finishes after this step and is
            # released as usual); set_finish_with_abort would rewrite its prompt under the tree.
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            self.req.to_finish = FINISH_ABORT(message, max(status, 500), "InternalServerError")
        else:
            self.req.set_finish_with_abort(message, status, kind)

    def keep_out_of_tree(self) -> None:
        self.req.skip_radix_cache_insert = True

    def replace_input_ids(self, ids: Sequence[int]) -> None:
        from array import array

        self.req.origin_input_ids = array("q", ids)

    def hide_from_client(self) -> None:
        self.req.finished_output = True  # SGLang sends nothing of it to the tokenizer manager


class SGLangRoundBudget:
    """SGLang's ``PrefillAdder`` as ``ports.RoundBudget``: both its remaining budgets read live."""

    __slots__ = ("adder",)

    def __init__(self, adder) -> None:
        self.adder = adder

    def room(self) -> int:
        return int(min(self.adder.rem_total_tokens, self.adder.cur_rem_tokens))


class SGLangBatch:
    """A ``ForwardBatch`` as the recorder and attention see it. Its host lists come from the scheduler's
    batch where the adapter has it (``rows``: built before the forward, so no layer reads a device tensor
    back -- under the overlap scheduler that would wait for the forward), else read once, lazily."""

    __slots__ = ("fb", "_rows", "_segments", "_seq_lens", "_shared")

    def __init__(self, forward_batch, rows: list[int] | None = None) -> None:
        self.fb = forward_batch
        self._rows: list[int] | None = rows
        self._segments: list[Segment] | None = None
        self._seq_lens: list[int] | None = None
        self._shared: dict = {}

    def shared(self, key, build):
        """What the layers of this forward batch share: ``build()`` once per batch and key (a device copy
        of host values made in the first layer, not in every layer)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def serves(self, forward_batch) -> bool:
        """Whether this view is of ``forward_batch``: the batch itself, or SGLang's copy of it into its
        runner's buffers (same mode, rows and host lengths)."""
        fb = self.fb
        if forward_batch.req_pool_indices is fb.req_pool_indices:
            return forward_batch.forward_mode == fb.forward_mode
        if forward_batch.forward_mode != fb.forward_mode or forward_batch.batch_size != fb.batch_size:
            return False
        mine, theirs = getattr(fb, "seq_lens_cpu", None), getattr(forward_batch, "seq_lens_cpu", None)
        return mine is not None and theirs is not None and torch.equal(mine, theirs)

    @property
    def is_extend(self) -> bool:
        return self.fb.forward_mode.is_extend()

    @property
    def is_decode(self) -> bool:
        return self.fb.forward_mode.is_decode()

    @property
    def rows(self) -> list[int]:
        if self._rows is None:
            cpu = getattr(self.fb, "req_pool_indices_cpu", None)
            self._rows = host_values(cpu) if cpu is not None else self.fb.req_pool_indices.tolist()  # once per view
        return self._rows

    @property
    def seq_lens(self) -> list[int]:
        """Each row's keys this forward, the new tokens included."""
        if self._seq_lens is None:
            cpu = getattr(self.fb, "seq_lens_cpu", None)
            self._seq_lens = host_values(cpu) if cpu is not None else self.fb.seq_lens.tolist()
        return self._seq_lens

    @property
    def segments(self) -> list[Segment]:
        if self._segments is None:
            fb = self.fb
            starts = list(itertools.accumulate(fb.extend_seq_lens_cpu[:-1], initial=0))  # host lengths, no device read
            self._segments = [
                Segment(index=i, row=row, start=starts[i], length=fb.extend_seq_lens_cpu[i],
                        prefix_len=fb.extend_prefix_lens_cpu[i])
                for i, row in enumerate(self.rows)
            ]
        return self._segments


# The fields of a decode ForwardBatch that hold one entry per row (cut to a sub-batch's rows).
_PER_ROW_FIELDS = (
    "input_ids", "req_pool_indices", "req_pool_indices_cpu", "seq_lens", "seq_lens_cpu", "orig_seq_lens",
    "out_cache_loc", "positions", "top_logprobs_nums", "token_ids_logprobs", "lora_ids", "rids", "rids_int",
    "encoder_lens", "encoder_lens_cpu", "temperature", "top_p",
)


def decode_sub_batch(forward_batch: Any, which: list[int], index: torch.Tensor) -> Any:
    """A copy of a decode ``ForwardBatch`` holding only the rows at positions ``which`` (a Full re-run
    of the rows that chose it; ``index``: ``which`` on the batch's device, built once by the caller); the
    forward plans its attention metadata afresh. SGLang's host mirrors (``*_cpu``) are cut on the host."""
    import copy

    size = forward_batch.batch_size
    sub = copy.copy(forward_batch)
    for name in _PER_ROW_FIELDS:
        value = getattr(forward_batch, name, None)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape[0] != size:
                raise NotImplementedError(f"decode sub-batch: field {name} has {value.shape[0]} entries for {size} rows")
            setattr(sub, name, value[which] if name.endswith("_cpu") else value.index_select(0, index))
        elif isinstance(value, list):
            setattr(sub, name, [value[i] for i in which])
    for name in ("mrope_positions", "spec_info", "global_num_tokens_cpu"):
        if getattr(forward_batch, name, None) is not None:
            raise NotImplementedError(f"decode sub-batch: {name} is set (not handled)")
    sub.batch_size = len(which)
    sub.seq_lens_sum = sum(host_values(sub.seq_lens_cpu)) if sub.seq_lens_cpu is not None else int(sub.seq_lens.sum())
    for name in ("global_num_token_non_padded", "num_token_non_padded"):  # MoE masks padded rows by it
        if getattr(sub, name, None) is not None:
            setattr(sub, name, torch.tensor(len(which), dtype=torch.int32, device=sub.input_ids.device))
    if getattr(sub, "global_num_token_non_padded_cpu", None) is not None:
        sub.global_num_token_non_padded_cpu = len(which)
    sub.forward_metadata_ready = False
    return sub
