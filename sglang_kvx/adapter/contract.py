"""Every SGLang function the extension hooks and every SGLang attribute it names, in one place.

``missing_in_installed_sglang()`` resolves each of them in the installed SGLang, so a version
bump fails one test (``tests/test_adapter_contract.py``) with one readable list instead of a
server that misbehaves. Registries used instead of hooks: ``register_attention_backend``
(``kvx_torch_native``), ``register_resolution_hook`` (CPU defaults), the platform and plugin
entry points.
"""

from __future__ import annotations

import pkgutil

HOOK_AFTER, HOOK_AROUND, HOOK_REPLACE = "after", "around", "replace"

# Scheduler processes: target -> (function in scheduler_hooks.py, hook kind). Each wraps the
# narrowest public (or, where SGLang has nothing else, private) function deciding that step.
SCHEDULER_HOOKS: dict[str, tuple[str, str]] = {
    "sglang.srt.managers.scheduler.Scheduler.__init__": ("after_scheduler_init", HOOK_AFTER),
    "sglang.srt.managers.scheduler.Scheduler.flush_cache": ("around_flush_cache", HOOK_AROUND),
    # SGLang's own extension point for per-request response fields: our outcome in meta_info["kvx"].
    "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class": ("after_get_output_streamer_class", HOOK_AFTER),
    # Where a request's prefix is matched: a child takes the store's rank slots instead.
    "sglang.srt.managers.schedule_batch.Req.init_next_round_input": ("around_init_next_round_input", HOOK_AROUND),
    # Where a queued request joins the next prefill: a child whose context is still being scored waits.
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": ("around_add_one_req", HOOK_AROUND),
    # Where SGLang drops a queued request aborted before it ran: a context it adopted is idle again.
    "sglang.srt.managers.scheduler.Scheduler._release_aborted_request": ("after_release_aborted_request", HOOK_AFTER),
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.prefix_device_indices": (
        "around_prefix_device_indices", HOOK_AROUND),
    # Rows are assigned here: children's offsets and recurrent states, parents' recordings; before it,
    # idle compacted contexts make way where the batch's allocation would otherwise fail.
    "sglang.srt.mem_cache.allocation.alloc_for_extend": ("around_alloc_for_extend", HOOK_AROUND),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": ("after_forward_batch_init", HOOK_AFTER),
    # Every layer's K/V as slices of one allocation: page tables reach cells a layer borrows from another.
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal": ("around_create_kv_buffers", HOOK_AROUND),
    "sglang.srt.mem_cache.common.release_kv_cache": ("around_release_kv_cache", HOOK_AROUND),
    # The decode step's room: idle unreserved compacted contexts go before SGLang retracts a request.
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.check_decode_capacity": (
        "around_check_decode_capacity", HOOK_AROUND),
    # SGLang clips a generation to what the pool could hold; a decode step bounding live KV lifts that.
    "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens": ("around_init_req_max_new_tokens", HOOK_AROUND),
    # The overlap scheduler processes a batch's results after launching the next: a decode step's first forward
    # waits for its prefill's (SGLang caches the prompt there, which moves what the step may free).
    "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch": (
        "around_is_disable_overlap_for_batch", HOOK_AROUND),
    # One decode forward: each row's span, a re-run where a decode step asks, then its drops.
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": ("around_model_forward", HOOK_AROUND),
    # Backend-agnostic: every attention backend runs under RadixAttention.forward.
    "sglang.srt.layers.radix_attention.RadixAttention.forward": ("after_attention", HOOK_AFTER),
    # GateSight's GDN signals: every GDN backend (ours on CPU, SGLang's on GPU) runs under it.
    "sglang.srt.layers.radix_linear_attention.RadixLinearAttention.forward": ("around_linear_attention", HOOK_AROUND),
    # Qwen3.5's gated attention computes its output gate here (GateSight's layer budgets).
    "sglang.srt.models.qwen3_5.Qwen3_5AttentionDecoderLayer._prepare_qkv_gate": ("after_prepare_qkv_gate", HOOK_AFTER),
    # Qwen3-Next's computes it here (CPU, CUDA) or in the fused gfx950 prologue.
    "sglang.srt.models.qwen3_next.Qwen3HybridAttentionDecoderLayer.forward_prepare_native": (
        "after_qwen3_next_prepare", HOOK_AFTER),
    "sglang.srt.models.qwen3_next.Qwen3HybridAttentionDecoderLayer.forward_prepare_fused": (
        "after_qwen3_next_prepare", HOOK_AFTER),
    # Per-layer lengths for whichever attention backend SGLang builds (its registry builds the
    # backend; no registry decorates one), and no captured graph for a batch that needs them.
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup._build_full_attention_backend_from_str": (
        "after_build_attention_backend", HOOK_AFTER),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph": (
        "around_can_run_graph", HOOK_AROUND),
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph": (
        "around_can_run_graph", HOOK_AROUND),
    "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner.can_run_graph": ("around_can_run_graph", HOOK_AROUND),
    # SGLang's idle leak check balances the pool against the tree and sessions; the store holds slots like a session.
    "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver.session_held_tokens": (
        "after_session_held_tokens", HOOK_AFTER),
    # Data parallelism: every routing method of SGLang's DP controller asks this first.
    "sglang.srt.managers.data_parallel_controller.DataParallelController.maybe_external_dp_rank_routing": (
        "around_dp_routing", HOOK_AROUND),
}

# Every process (plugin.py): flags, validation, stats.
PLUGIN_HOOKS: list[str] = [
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
]

# The HTTP process (door.py): request validation before the scheduler.
DOOR_HOOKS: list[str] = ["sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"]
# The HTTP process (usage.py): a child's prompt and cached tokens as SGLang defines them. Every output
# batch passes through the first before anything reads its counts; the second is where SGLang counts
# cached tokens by their literal source, beside which the extension's sources are counted.
USAGE_HOOKS: dict[str, tuple[str, str]] = {
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output": (
        "around_handle_batch_output", HOOK_AROUND),
    "sglang.srt.observability.metrics_collector.TokenizerMetricsCollector.observe_one_finished_request": (
        "after_observe_one_finished_request", HOOK_AFTER),
}

# CPU platform only (plugin.py): no GDN kernel registry exists, so one class and a few Triton
# functions SGLang's model code calls directly get torch stand-ins; one constructor is wrapped.
# Triton functions SGLang's model code calls outside any registry -> torch stand-ins (cpu_standins.py).
CPU_STANDINS: dict[str, str] = {
    "sglang.kernels.ops.attention.triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat_contiguous": "split_qkvzba_contiguous",
    "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward": "rms_norm_gated_forward",
    "sglang.kernels.ops.elementwise.elementwise.fused_sigmoid_mul": "sigmoid_gate_mul",
    # Qwen3-Next: grouped [q k v z] projection layout, and its GDN output norm.
    "sglang.kernels.ops.attention.triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat": "split_qkvzba_grouped",
    "sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward": "fused_rms_norm_gated_forward",
    # ... and its MoE's gated shared expert.
    "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add": "shared_expert_gate_add",
}
GDN_BACKEND_CLASS = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
GDN_LAYER_INIT = "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__"
CPU_HOOKS: list[str] = [GDN_BACKEND_CLASS, *CPU_STANDINS, GDN_LAYER_INIT]

# CPU platform under SGLANG_KVX_EMULATE_GRAPHS=1 (graph_runners.py): SGLang's graph runners, emulated.
_GRAPH_SETUP = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"
EMULATION_HOOKS: dict[str, tuple[str, str]] = {
    f"{_GRAPH_SETUP}.capture_decode_graph": ("around_capture_decode_graph", HOOK_AROUND),
    f"{_GRAPH_SETUP}.PrefillCudaGraphRunner": ("EmulatedPrefillGraph", HOOK_REPLACE),
}

# The launcher on the CPU platform under SGLANG_KVX_CPU_FORKSERVER=1 (plugin.py): after SGLang picks its
# start method (spawn), its scheduler and detokenizer start from a forkserver that imported their modules.
FORKSERVER_HOOK = "sglang.srt.entrypoints.engine._set_envs_and_config"
FORKSERVER_PRELOAD: list[str] = [
    "sglang.launch_server",  # what spawn's preparation data re-runs as __mp_main__ in every child
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
]

# Modules and names imported directly (registries, base classes, helpers).
IMPORTED: list[str] = [
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.arg_groups.overrides.declare_resolution",
    "sglang.srt.arg_groups.overrides.resolving_view",
    "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
    "sglang.srt.arg_groups.overrides.attention_backends_of",
    "sglang.srt.model_executor.cuda_graph_config.with_phase",
    "sglang.srt.model_executor.cuda_graph_config.Backend",
    "sglang.srt.model_executor.cuda_graph_config.Phase",
    "sglang.srt.model_executor.runner_utils.capture_mode.get_capture_attention_variant",
    "sglang.srt.model_executor.runner_utils.capture_mode._set_capture_attention_variant",
    "sglang.srt.layers.radix_attention.RadixAttention",
    "sglang.srt.arg_groups.choices.add_attention_backend_choices",
    "sglang.srt.layers.attention.attention_registry.register_attention_backend",
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
    "sglang.srt.layers.attention.triton_backend.logit_capping_mod",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase",
    "sglang.srt.mem_cache.memory_pool.KVWriteLoc",
    "sglang.srt.mem_cache.common.match_kv_cache",
    "sglang.srt.mem_cache.common.evict_from_tree_cache",
    "sglang.srt.distributed.get_tp_group",
    "sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS",
    "sglang.srt.managers.schedule_policy.AddReqResult",
    "sglang.srt.managers.io_struct.TokenizedGenerateReqInput",
    "sglang.srt.managers.schedule_batch.FINISH_ABORT",
    "sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode",
    "sglang.srt.sampling.sampling_params.SamplingParams",
    "sglang.srt.platforms.cpu.CpuDeviceMixin",
    "sglang.srt.platforms.interface.SRTPlatform",
    "sglang.srt.utils.numa_utils.get_cpu_ids_by_node",
    "sglang.srt.entrypoints.http_server.app",
]

# SGLang attention backends whose own kernels read a layer's page table, -> the module (of this package)
# defining their reader class, imported where SGLang builds such a backend (``after_build_attention_backend``)
# so that only servers running that backend import it. ``kvx_torch_native`` is defined with the rest
# (``attention.py``). Every other backend reads compacted rows through ``masked_attention``.
PAGE_TABLE_READERS: dict[str, str] = {
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend": "sglang_kvx.adapter.triton_tables",
}

# Instance attributes the views and hooks read or write, by the class that defines them
# (checked in SGLang's source text: instances exist only in a running server).
ATTRIBUTES: dict[str, list[str]] = {
    "sglang.srt.managers.schedule_batch.Req": [
        "origin_input_ids", "output_ids", "sampling_params", "rid", "kv", "prefix_len", "num_matched_prefix_tokens",
        "skip_radix_cache_insert", "finished_output", "finished_reason", "to_finish", "set_finish_with_abort",
        "finished", "owned_kv_len", "full_untruncated_fill_ids",
    ],
    "sglang.srt.managers.schedule_policy.PrefillAdder": [
        "tree_cache", "can_run_list", "rem_total_tokens", "cur_rem_tokens", "per_req_token_overhead",
    ],
    "sglang.srt.managers.schedule_batch.ScheduleBatch": ["reqs", "extend_num_tokens", "token_to_kv_pool_allocator"],
    "sglang.srt.managers.scheduler.Scheduler": [
        "token_to_kv_pool_allocator", "req_to_token_pool", "tree_cache", "tp_worker", "tp_size", "page_size", "server_args",
        "model_config", "max_total_num_tokens", "handle_generate_request", "metrics_collector",
    ],
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": [
        "forward_mode", "req_pool_indices", "positions", "extend_seq_lens", "extend_start_loc",
        "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "capture_hidden_mode",
        "input_ids", "batch_size", "req_pool_indices_cpu",
    ],
    "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool": ["get_mamba_indices", "mamba_pool"],
    "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector": ["labels"],
    "sglang.srt.model_executor.model_runner.ModelRunner": ["kv_cache_dtype", "model_config"],
    "sglang.srt.configs.model_config.ModelConfig": ["model_path"],
    "sglang.srt.mem_cache.memory_pool.MambaPool": ["get_cpu_copy", "load_cpu_copy", "mamba_cache", "_slot_siblings"],
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator": [
        "available_size", "alloc", "free", "free_group", "free_group_begin", "free_group_end",
    ],
}


def all_targets() -> list[str]:
    return [*SCHEDULER_HOOKS, *PLUGIN_HOOKS, *DOOR_HOOKS, *USAGE_HOOKS, *CPU_HOOKS, *EMULATION_HOOKS, FORKSERVER_HOOK,
            *FORKSERVER_PRELOAD, *IMPORTED]


def missing_in_installed_sglang() -> list[str]:
    """Every hook target, imported name and attribute above that the installed SGLang lacks."""
    import inspect

    missing = []
    for target in all_targets():
        try:
            pkgutil.resolve_name(target)  # walks "package.module.Class.attribute"
        except Exception:  # noqa: BLE001 - any failure to resolve is what this check reports
            missing.append(target)
    for cls_path, names in ATTRIBUTES.items():
        try:
            cls = pkgutil.resolve_name(cls_path)
            source = inspect.getsource(inspect.getmodule(cls))
        except Exception:  # noqa: BLE001
            missing.append(cls_path)
            continue
        missing.extend(f"{cls_path}.{name}" for name in names
                       if not hasattr(cls, name) and f".{name}" not in source and f"{name}:" not in source)
    return missing


def check_applied() -> None:
    """SGLang only logs a hook it could not apply; compaction without all of them would be wrong."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched = getattr(HookRegistry, "_patched", None)
    if patched is None:
        return  # this SGLang does not expose what it applied; the contract test covers the targets
    # (The DP controller's routing hook applies in that controller's own process.)
    missing = [target for target in SCHEDULER_HOOKS if target not in patched and ".data_parallel_controller." not in target]
    if missing:
        raise RuntimeError(f"sglang_kvx: SGLang hooks not applied: {', '.join(missing)}")
