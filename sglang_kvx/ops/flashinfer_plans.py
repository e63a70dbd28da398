"""FlashInfer batch decode over SGLang's pool, planned once per forward batch and run per layer.

FlashInfer splits a batch decode into ``plan`` (host work on the index sets: the work partition,
a host round trip) and ``run`` (the kernel). ``DecodePlans`` keeps one planned wrapper for each
distinct ``key`` of the current forward batch: the first layer that reads a given set of cells
plans, every later layer with the same key only runs. The caller names the key (two calls with one
key read the same cells: the window op keys by each row's slot ranges, known on the host); the
shapes, dtypes and scale are added to it here; ``key=None`` plans on every call.
``begin_batch()`` forgets the last batch's plans; the wrappers and their shared workspace stay for
the next batch (FlashInfer's wrappers are meant to be planned again). SGLang's pool is FlashInfer's
paged layout with page size 1, so any set of cells is an explicit page list.

Untested on this project's machines (no GPU): written from FlashInfer 0.7's documented API
(``BatchDecodeWithPagedKVCacheWrapper.plan/run``) and used only where flashinfer imports on CUDA;
on CPU a stand-in module bound to the installed FlashInfer's signatures checks the index sets, the
results and the plan count (``tests/test_ops_window_attention.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k workspace, shared by every wrapper


def flashinfer_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why FlashInfer's decode kernels cannot take these tensors, or None: they need half-precision
    queries, one head size for K and V in (64, 128, 256), a cache of q's dtype or fp8."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "fp16/bf16 queries"
    if k_cache.shape[-1] != v_cache.shape[-1] or k_cache.shape[-1] not in (64, 128, 256):
        return "K and V of one head size in (64, 128, 256)"
    if k_cache.dtype != q.dtype and k_cache.element_size() != 1:
        return "a cache of the queries' dtype (or fp8)"
    return None


def use_tensor_cores(q_heads: int, kv_heads: int, k_cache: torch.Tensor) -> bool:
    """SGLang's rule for its decode wrappers: tensor cores for wide GQA groups and fp8 caches."""
    return q_heads // kv_heads > 4 or k_cache.element_size() == 1


def slot_ranges(req_to_token: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices) for the slots of ``req_to_token[rows[b], start[b]:end[b]]``."""
    lengths = end - start
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.long, device=rows.device)
    indptr[1:] = torch.cumsum(lengths, 0)
    total = int(indptr[-1])
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), lengths, output_size=total)
    columns = start[owner] + torch.arange(total, device=rows.device) - indptr[owner]
    return indptr.to(torch.int32), req_to_token[rows[owner], columns].to(torch.int32)


class DecodePlans:
    """Planned FlashInfer decode wrappers of one forward batch (one object per scheduler process)."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.workspace_bytes = workspace_bytes
        self.plan_count = 0  # plans made, over the object's life (tests and benchmarks read it)
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._spare: dict[tuple[torch.device, bool], list] = {}
        self._planned: dict[Hashable, tuple[tuple[torch.device, bool], object]] = {}

    def begin_batch(self) -> None:
        """A new forward batch: its cells are new, so every plan goes; the wrappers stay."""
        for kind, wrapper in self._planned.values():
            self._spare.setdefault(kind, []).append(wrapper)
        self._planned.clear()

    def run(self, key: Hashable | None, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor],
            index_sets: Callable[[], tuple[torch.Tensor, torch.Tensor]], scaling: float, tensor_cores: bool,
            k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, Hq, Dv], lse [B, Hq]) of a batch decode of ``q`` [B, Hq, D] over ``paged_kv``
        ([P, 1, Hkv, D] keys and values), each query over the pages ``index_sets()`` gives
        (called only when a plan is made)."""
        k_pages = paged_kv[0]
        kind = (q.device, tensor_cores)
        full_key = None if key is None else (key, kind, tuple(q.shape), tuple(k_pages.shape[2:]), q.dtype,
                                             k_pages.dtype, scaling)
        planned = self._planned.get(full_key) if full_key is not None else None
        if planned is None:
            wrapper = self._take(kind)
            indptr, indices = index_sets()
            wrapper.plan(indptr, indices, torch.ones(q.shape[0], dtype=torch.int32, device=q.device),
                         q.shape[1], k_pages.shape[2], k_pages.shape[3], 1,
                         q_data_type=q.dtype, kv_data_type=k_pages.dtype, sm_scale=scaling)
            self.plan_count += 1
            if full_key is not None:
                self._planned[full_key] = (kind, wrapper)
            else:
                self._spare.setdefault(kind, []).append(wrapper)  # free for the next call once this one is queued
        else:
            wrapper = planned[1]
        # Own output buffers: a caller may merge this result with another run's.
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        return wrapper.run(q.contiguous(), paged_kv, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True)

    def _take(self, kind: tuple[torch.device, bool]):
        spare = self._spare.get(kind)
        if spare:
            return spare.pop()
        import flashinfer

        device, tensor_cores = kind
        if device not in self._workspace:
            self._workspace[device] = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace[device], kv_layout="NHD",
                                                            use_tensor_cores=tensor_cores)
