"""``/kvx/stats``: figures read from SGLang's real pools, never from counters kept beside them."""

from __future__ import annotations

from typing import Any

from sglang_kvx.adapter.forward import link_of
from sglang_kvx.config import KvxConfig
from sglang_kvx.ops.dispatch import fallbacks


def scheduler_stats(scheduler, config: KvxConfig, runtime=None) -> dict[str, Any]:
    """Stats of one scheduler (one DP rank), computed from its allocator, tree cache and store now."""
    allocator = scheduler.token_to_kv_pool_allocator
    tree_cache = scheduler.tree_cache
    stats = {
        "policy": config.policy,
        "keep_fraction": config.keep_fraction,
        # Every --kvx-* setting the server runs with (a benchmark pointed at it with --url reads them).
        "settings": config.report(),
        "kv_pool_total_tokens": int(scheduler.max_total_num_tokens),
        "kv_pool_free_tokens": int(allocator.available_size()),
        # Tokens held by the radix cache that no running request uses: free on demand.
        "kv_pool_evictable_tokens": int(tree_cache.evictable_size()),
        "kv_pool_protected_tokens": int(tree_cache.protected_size()),
    }
    from sglang_kvx.adapter.graph_runners import graph_replays

    replays = graph_replays(scheduler.tp_worker.model_runner)
    if replays:  # the CPU graph emulation is on
        stats["graph_replays"] = replays
    link = link_of(scheduler.req_to_token_pool)
    if link is not None:  # batches the plugin kept off captured graphs, by reason (around_can_run_graph)
        stats["graph_declines"] = dict(link.graph_declines)
        stats["masked_attention_calls"] = link.masked_attention_calls
        if link.host_syncs is not None:  # SGLANG_KVX_COUNT_HOST_SYNCS=1 (scheduler_hooks.around_model_forward)
            stats["host_syncs"] = dict(link.host_syncs)
    # Kernels that failed at their start-up check or inside a forward: the torch reference serves them now.
    stats["op_fallbacks"] = fallbacks()
    if runtime is not None:
        total, free = stats["kv_pool_total_tokens"], stats["kv_pool_free_tokens"]
        stats["protected_prefix_len"] = config.protected_prefix_len
        bytes_per_token = runtime.pool.bytes_per_entry * runtime.pool.num_layers
        stats["kv_bytes_total"] = total * bytes_per_token
        stats["kv_bytes_used"] = (total - free) * bytes_per_token
        stats.update(runtime.stats())
    return stats
