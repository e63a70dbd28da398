"""CuPy kernel for ``ops.block_sparse.compress_blocks``, used only where ``cupy`` imports and the
keys are on CUDA (CuPy is the optional ``gpu`` extra). NOT TESTED on this project's CPU-only
machines: its test runs whenever cupy imports with a CUDA device.

One thread per (block, KV head, dimension): the mean over the block's valid entries, reading the
pool's cells (slot < pool size) or the extra borrowed cells, written as float32; launched on torch's
current stream so it orders with the model's work.
"""

from __future__ import annotations

import cupy
import torch

_SOURCE = r"""
extern "C" __global__ void compress_blocks(const ELEM* keys, const ELEM* extra, const long long* slots,
                                           float* out, long long blocks, long long heads, long long dim,
                                           long long pool, long long k_sp, long long k_sh,
                                           long long e_sp, long long e_sh) {
    long long total = blocks * heads * dim;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long d = e % dim;
        long long h = (e / dim) % heads;
        long long b = e / (dim * heads);
        float sum = 0.0f;
        int count = 0;
        for (int j = 0; j < 4; ++j) {
            long long slot = slots[b * 4 + j];
            if (slot < 0) continue;
            sum += slot < pool ? (float)keys[slot * k_sp + h * k_sh + d]
                               : (float)extra[(slot - pool) * e_sp + h * e_sh + d];
            ++count;
        }
        out[e] = count ? sum / count : 0.0f;
    }
}
"""
_C_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_HEADERS = {torch.float16: "#include <cuda_fp16.h>\n", torch.bfloat16: "#include <cuda_bf16.h>\n"}
_kernels: dict[torch.dtype, cupy.RawKernel] = {}
_THREADS = 256


def _kernel(dtype: torch.dtype) -> cupy.RawKernel:
    if dtype not in _kernels:
        source = _HEADERS.get(dtype, "") + _SOURCE.replace("ELEM", _C_TYPES[dtype])
        _kernels[dtype] = cupy.RawKernel(source, "compress_blocks")
    return _kernels[dtype]


def compress_blocks_cupy(k_cache: torch.Tensor, block_slots: torch.Tensor,
                         extra_keys: torch.Tensor | None = None) -> torch.Tensor:
    blocks, (_, heads, dim) = block_slots.shape[0], k_cache.shape
    if k_cache.stride(2) != 1:
        raise ValueError("the CuPy block compression needs a contiguous last dimension in the key cache")
    extra = k_cache if extra_keys is None or extra_keys.numel() == 0 else extra_keys.to(k_cache.dtype).contiguous()
    slots = block_slots.to(torch.int64).contiguous()
    out = torch.empty((blocks, heads, dim), dtype=torch.float32, device=k_cache.device)
    total = blocks * heads * dim
    if total == 0:
        return out
    grid = min((total + _THREADS - 1) // _THREADS, 65535 * 8)  # grid-stride loop covers the rest
    with cupy.cuda.Device(k_cache.device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(k_cache.device).cuda_stream):
        _kernel(k_cache.dtype)(
            (grid,), (_THREADS,),
            (cupy.uint64(k_cache.data_ptr()), cupy.uint64(extra.data_ptr()), cupy.uint64(slots.data_ptr()),
             cupy.uint64(out.data_ptr()), cupy.int64(blocks), cupy.int64(heads), cupy.int64(dim),
             cupy.int64(k_cache.shape[0]), cupy.int64(k_cache.stride(0)), cupy.int64(k_cache.stride(1)),
             cupy.int64(extra.stride(0)), cupy.int64(extra.stride(1))))
    return out
