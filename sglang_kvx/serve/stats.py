"""``/kvx/stats``: figures read from SGLang's real pools, never from counters kept beside them."""

from __future__ import annotations

from typing import Any

from sglang_kvx.config import KvxConfig


def scheduler_stats(scheduler, config: KvxConfig) -> dict[str, Any]:
    """Stats of one scheduler (one DP rank), computed from its allocator and tree cache now."""
    allocator = scheduler.token_to_kv_pool_allocator
    tree_cache = scheduler.tree_cache
    return {
        "policy": config.policy,
        "keep_fraction": config.keep_fraction,
        "kv_pool_total_tokens": int(scheduler.max_total_num_tokens),
        "kv_pool_free_tokens": int(allocator.available_size()),
        # Tokens held by the radix cache that no running request uses: free on demand.
        "kv_pool_evictable_tokens": int(tree_cache.evictable_size()),
        "kv_pool_protected_tokens": int(tree_cache.protected_size()),
    }
