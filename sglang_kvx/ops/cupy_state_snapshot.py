"""CuPy kernel for ``ops.state_snapshot``, used only where ``cupy`` imports and the state is on
CUDA (CuPy is the optional ``gpu`` extra). NOT TESTED on this project's CPU-only machines: its
test runs whenever cupy imports with a CUDA device.

The same flat copy of slot rows as the Triton kernel, as a RawKernel over raw integers of the
state's element size, launched on torch's current stream so it orders with the model's work.
"""

from __future__ import annotations

import cupy
import torch

_SOURCE = r"""
extern "C" __global__ void copy_rows(const ELEM* src, ELEM* dst, const long long* slots,
                                     long long n, long long outer, long long inner,
                                     long long src_so, long long src_sr, long long dst_so,
                                     long long dst_sr, int scatter) {
    long long total = outer * n * inner;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long i = e % inner;
        long long r = (e / inner) % n;
        long long o = e / (inner * n);
        long long slot = slots[r];
        long long src_row = scatter ? r : slot;
        long long dst_row = scatter ? slot : r;
        dst[o * dst_so + dst_row * dst_sr + i] = src[o * src_so + src_row * src_sr + i];
    }
}
"""
_C_TYPES = {torch.uint8: "unsigned char", torch.int16: "short", torch.int32: "int", torch.int64: "long long"}
_kernels: dict[str, cupy.RawKernel] = {}
_THREADS = 256


def _kernel(c_type: str) -> cupy.RawKernel:
    if c_type not in _kernels:
        _kernels[c_type] = cupy.RawKernel(_SOURCE.replace("ELEM", c_type), "copy_rows")
    return _kernels[c_type]


def copy_rows_cupy(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, scatter: bool) -> None:
    """src/dst: [outer, rows, inner] integer views with a contiguous inner dim; slots: int64 [n]."""
    outer, _, inner = src.shape
    n = slots.numel()
    total = outer * n * inner
    if total == 0:
        return
    blocks = min((total + _THREADS - 1) // _THREADS, 65535 * 8)  # grid-stride loop covers the rest
    with cupy.cuda.Device(src.device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(src.device).cuda_stream):
        # Raw device pointers (data_ptr includes a view's offset): no array interop, whose stream
        # handshake could synchronise the host.
        _kernel(_C_TYPES[src.dtype])(
            (blocks,), (_THREADS,),
            (cupy.uint64(src.data_ptr()), cupy.uint64(dst.data_ptr()), cupy.uint64(slots.data_ptr()),
             cupy.int64(n), cupy.int64(outer),
             cupy.int64(inner), cupy.int64(src.stride(0)), cupy.int64(src.stride(1)),
             cupy.int64(dst.stride(0)), cupy.int64(dst.stride(1)), cupy.int32(int(scatter))))
