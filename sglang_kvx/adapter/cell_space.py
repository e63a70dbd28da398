"""Every attention layer's KV cells as one address space, where SGLang's pool allows it.

A folded compacted context keeps some of layer l's ranks in cells of other layers' buffers
(``compact/layout.py``). A page table can list those cells for layer l only if one tensor reaches
every layer's cells. SGLang allocates each layer's K and V as the two halves of one tensor per
layer (so that paged kernels reach V from K's base); ``around_create_kv_buffers`` makes those
per-layer tensors slices of one allocation instead -- the same shapes, strides and bytes per
layer, so nothing else in SGLang changes -- and ``cell_space_of`` finds it by the buffers' storage
(no flag: a pool built any other way simply has no cell space, and such layers stay masked).
"""

from __future__ import annotations

import torch

from sglang_kvx.serve.page_tables import CellSpace

SPACE_ATTR = "_kvx_cell_space"


def cell_space_of(pool, layer_ids: list[int]) -> CellSpace | None:
    """The pool's cell space over attention layers ``layer_ids`` (cached on it), or None where their K/V
    buffers are not rows of one allocation with V a fixed number of rows after K in every layer."""
    if not hasattr(pool, SPACE_ATTR):
        object.__setattr__(pool, SPACE_ATTR, _find_space(pool, layer_ids))
    return getattr(pool, SPACE_ATTR)


def _find_space(pool, layer_ids: list[int]) -> CellSpace | None:
    keys = [pool.get_key_buffer(layer_id) for layer_id in layer_ids]
    values = [pool.get_value_buffer(layer_id) for layer_id in layer_ids]
    if not keys:
        return None
    first = keys[0]
    if first.dim() != 3 or any(b.shape != first.shape or b.dtype != first.dtype or not b.is_contiguous()
                               for b in [*keys, *values]):
        return None
    storage = first.untyped_storage()
    if any(b.untyped_storage().data_ptr() != storage.data_ptr() for b in [*keys, *values]):
        return None  # SGLang's own allocation: one tensor per layer
    row_bytes = first[0].numel() * first.element_size()
    base = storage.data_ptr()
    offsets = [b.data_ptr() - base for b in [*keys, *values]]
    if any(offset % row_bytes for offset in offsets):
        return None
    k_rows, v_rows = [o // row_bytes for o in offsets[: len(keys)]], [o // row_bytes for o in offsets[len(keys):]]
    v_after = {v - k for k, v in zip(k_rows, v_rows)}
    if len(v_after) != 1 or min(v_after) < 0:
        return None
    total = storage.nbytes() // row_bytes
    heads, dim = first.shape[1:]
    cells = first.new_empty(0).set_(storage, 0, (total, heads, dim), (heads * dim, dim, 1))
    return CellSpace(keys=cells, values=cells[v_after.pop():], offsets=dict(zip(layer_ids, k_rows)))


def around_create_kv_buffers(original, pool, *args, **kwargs):
    """SGLang's ``MHATokenToKVPool._create_buffers_normal``, with every layer's [2, rows, H, D] K/V tensor a
    slice of one [layers, 2, rows, H, D] allocation when compaction is on and the pool is SGLang's plain
    token-major layout with equal K and V shapes (otherwise SGLang's own, unchanged: such layers' borrowed
    cells stay on the masked path). Wrapped, not replaced by a registry: SGLang offers no allocation hook."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.runtime_context import get_server_args

    from sglang_kvx.adapter.server_config import config_of

    try:
        server_args = get_server_args()
    except ValueError:  # SGLang's "not set yet": a pool built outside a server process (a test's)
        server_args = None
    k_shape, v_shape = pool._kv_buffer_shapes()
    if (server_args is None or not config_of(server_args).enabled or pool.kv_cache_layout != "nhd"
            or getattr(pool, "enable_custom_mem_pool", False) or k_shape != v_shape or pool.layer_num < 2):
        return original(pool, *args, **kwargs)
    rows = k_shape[0]
    padded = -(-rows // pool.page_size) * pool.page_size  # SGLang pads each half to whole pages
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
        arena = torch.zeros((pool.layer_num, 2, padded, *k_shape[1:]), dtype=pool.store_dtype, device=pool.device)
    pool.k_buffer = [arena[layer, 0, :rows] for layer in range(pool.layer_num)]
    pool.v_buffer = [arena[layer, 1, :rows] for layer in range(pool.layer_num)]
    return None
