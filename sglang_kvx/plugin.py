"""The SGLang integration layer: the ONLY module that touches SGLang internals.

SGLang calls :func:`load` (entry point ``sglang.srt.plugins``) early in every
process it starts: the launcher, the scheduler, the detokenizer. Everything
here goes through SGLang's own extension points:

- ``HookRegistry`` hooks on the argument parser (our ``--kvx-*`` flags) and on
  ``ServerArgs.from_cli_args`` (validation before any model loads);
- ``register_resolution_hook`` for CPU-platform defaults;
- ``register_attention_backend`` for ``kvx_torch_native`` (torch attention with
  per-layer lengths of compacted prefixes), and an AFTER hook on SGLang's backend
  factory that gives any other full-attention backend the same per-layer lengths;
- on the CPU platform only, a class swap of ``GDNAttnBackend`` for the pure-torch
  GDN backend and torch stand-ins for three Triton calls (no GDN registry exists);
- in scheduler processes, narrow hooks around the functions that decide a
  request's prefix, positions and release (see ``_register_compaction_hooks``);
- an AFTER hook on ``Scheduler.get_internal_state`` that reports our stats
  from SGLang's real pools, and FastAPI routes on SGLang's own app.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Any

from sglang_kvx.config import (
    KvxConfig,
    KvxConfigError,
    add_cli_args,
    build_config,
    check_tensor_parallel,
    marks_context,
)

logger = logging.getLogger(__name__)

# server_args carries the validated config to every process as bookkeeping
# (an underscore attribute: ServerArgs pickles those along with its fields).
CONFIG_ATTR = "_kvx_config"


def load() -> None:
    """Entry point of SGLang's ``sglang.srt.plugins`` group."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", _after_get_internal_state, HookType.AFTER
    )
    _register_platform_defaults()
    _register_attention_backend()
    _register_gdn_backend()
    if multiprocessing.parent_process() is None:
        _register_http_routes()
    else:
        _register_compaction_hooks()


# --- flags -----------------------------------------------------------------


def _after_add_cli_args(_result: Any, parser) -> None:
    add_cli_args(parser)


def _around_from_cli_args(original, cls, args, *rest, **kwargs):
    server_args = original(cls, args, *rest, **kwargs)
    try:
        config = build_config(
            policy=getattr(args, "kvx_policy", "none"),
            keep_fraction=getattr(args, "kvx_keep_fraction", "1.0"),
            model_path=getattr(args, "model_path", None),
            protected_prefix_len=getattr(args, "kvx_protected_prefix_len", "0"),
            estimator=getattr(args, "kvx_estimator", ""),
        )
        if config.enabled:
            check_tensor_parallel(config.policy, None, int(server_args.tp_size or 1))
    except KvxConfigError as exc:
        # One line, argparse-style, before anything heavy starts.
        print(f"sglang-kvx: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    attach_config(server_args, config)
    return server_args


def attach_config(server_args, config: KvxConfig) -> None:
    setattr(server_args, CONFIG_ATTR, config.to_dict())
    if config.policy != "none":
        logger.info("sglang_kvx: policy=%s keep_fraction=%g", config.policy, config.keep_fraction)


def config_of(server_args) -> KvxConfig:
    """The config a process was started with (``none`` when launched without our flags)."""
    raw = getattr(server_args, CONFIG_ATTR, None)
    return KvxConfig(**raw) if raw else KvxConfig()


# --- CPU platform defaults -----------------------------------------------------


def _register_platform_defaults() -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    @register_resolution_hook("handle_missing_default_values")
    def _cpu_device_default(server_args, previous):
        # SGLang's own default asks an out-of-tree platform for a torch.device
        # and then splits it like a string; name the device first.
        from sglang.srt.platforms import current_platform

        from sglang_kvx.platform.cpu import KvxCpuPlatform

        if isinstance(current_platform, KvxCpuPlatform):
            view = resolving_view(server_args)
            if view.device is None:
                declare_resolution(server_args, "sglang_kvx:cpu_platform", device="cpu")
            # SGLang picks torch_native for device "cpu" before asking the platform.
            if view.attention_backend is None:
                declare_resolution(server_args, "sglang_kvx:cpu_platform", attention_backend=KVX_TORCH_ATTENTION)
            _default_cpu_thread_binding(server_args)
        previous(server_args)


def _default_cpu_thread_binding(server_args) -> None:
    """More CPU ranks than NUMA nodes: SGLang refuses to start unless SGLANG_CPU_OMP_THREADS_BIND
    names each rank's cores. Unless the user set it, split this process's cores evenly (ranks share
    cores round-robin when there are more ranks than cores). Set before the ranks are spawned."""
    ranks = 1
    for size in (server_args.dp_size, server_args.tp_size, server_args.pp_size):
        ranks *= max(1, int(size or 1))
    if ranks == 1 or os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        return
    from sglang.srt.utils.numa_utils import get_cpu_ids_by_node

    if ranks <= len(get_cpu_ids_by_node()):
        return  # SGLang's own default: one NUMA node per rank
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), ranks)
    logger.info("sglang_kvx: %d CPU ranks, SGLANG_CPU_OMP_THREADS_BIND=%s", ranks, os.environ["SGLANG_CPU_OMP_THREADS_BIND"])


def cpu_thread_binding(cores: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``ranks`` ranks over ``cores``: contiguous equal shares."""
    if not cores or ranks < 1:
        raise ValueError(f"need cores and ranks >= 1, got {cores} and {ranks}")
    if ranks >= len(cores):
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    share = len(cores) // ranks
    groups = [cores[r * share : (r + 1) * share] for r in range(ranks)]

    def spell(group: list[int]) -> str:  # SGLang's own examples write ranges: 0-15|16-31
        if group == list(range(group[0], group[-1] + 1)):
            return f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])
        return ",".join(str(c) for c in group)

    return "|".join(spell(group) for group in groups)


KVX_TORCH_ATTENTION = "kvx_torch_native"


def _register_attention_backend() -> None:
    """SGLang's torch-native attention plus per-layer lengths of compacted prefixes (CPU default)."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if KVX_TORCH_ATTENTION in ATTENTION_BACKENDS:
        return
    add_attention_backend_choices([KVX_TORCH_ATTENTION])

    @register_attention_backend(KVX_TORCH_ATTENTION)
    def _create(runner):
        from sglang_kvx.compact.attention import KvxTorchNativeAttnBackend

        return KvxTorchNativeAttnBackend(runner)


def _on_cpu_platform() -> bool:
    from sglang.srt.platforms import current_platform

    from sglang_kvx.platform.cpu import KvxCpuPlatform

    return isinstance(current_platform, KvxCpuPlatform)


# Triton functions SGLang's model code calls outside any registry -> torch stand-ins.
CPU_STANDINS = {
    "sglang.kernels.ops.attention.triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat_contiguous": "split_qkvzba_contiguous",
    "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward": "rms_norm_gated_forward",
    "sglang.kernels.ops.elementwise.elementwise.fused_sigmoid_mul": "sigmoid_gate_mul",
    # Qwen3-Next: grouped [q k v z] projection layout, and its GDN output norm.
    "sglang.kernels.ops.attention.triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat": "split_qkvzba_grouped",
    "sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward": "fused_rms_norm_gated_forward",
    # ... and its MoE's gated shared expert.
    "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add": "shared_expert_gate_add",
}


def _register_gdn_backend() -> None:
    """On the CPU platform, serve GDN layers with our pure-torch backend.

    SGLang has no registry for GDN kernels: its hybrid wrapper builds
    ``gdn_backend.GDNAttnBackend`` by name, so we replace that one class, and
    the few Triton functions in CPU_STANDINS, only when the CPU platform is
    active. GPU machines keep SGLang's own kernels untouched.
    """
    if not _on_cpu_platform() or multiprocessing.parent_process() is None:
        return  # model code runs only in scheduler subprocesses
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_kvx.models import cpu_standins
    from sglang_kvx.models.gdn_backend import TorchGDNAttnBackend

    HookRegistry.register(
        "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend", TorchGDNAttnBackend, HookType.REPLACE
    )
    for target, name in CPU_STANDINS.items():
        HookRegistry.register(target, getattr(cpu_standins, name), HookType.REPLACE)
    HookRegistry.register(
        "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__", _around_gdn_layer_init_on_cpu, HookType.AROUND
    )


def _around_gdn_layer_init_on_cpu(original, layer, *args, **kwargs):
    """Qwen3-Next's GDN layer builds its output norm on ``torch.get_device_module().current_device()``,
    which is CUDA for a CUDA build of torch even on a machine without a GPU. No hook reaches that
    one expression, so while this constructor runs (CPU platform only) the device module is CPU's."""
    import torch

    device_module = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else device_module(device)
    try:
        return original(layer, *args, **kwargs)
    finally:
        torch.get_device_module = device_module


# --- compaction (scheduler processes) ------------------------------------------------
#
# SGLang has no extension point for "this request's prefix comes from elsewhere",
# so compaction wraps the narrow functions that decide a request's prefix and
# positions, each delegating to the one KvxRuntime of this scheduler process
# (None when the policy is ``none``: every wrapper then passes straight through).

_RUNTIME = None


def _register_compaction_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = {
        "sglang.srt.managers.scheduler.Scheduler.__init__": (_after_scheduler_init, HookType.AFTER),
        "sglang.srt.managers.scheduler.Scheduler.flush_cache": (_around_flush_cache, HookType.AROUND),
        "sglang.srt.managers.schedule_batch.Req.init_next_round_input": (_around_init_next_round_input, HookType.AROUND),
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.prefix_device_indices": (
            _around_prefix_device_indices, HookType.AROUND),
        "sglang.srt.mem_cache.allocation.alloc_for_extend": (_after_alloc_for_extend, HookType.AFTER),
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": (_after_forward_batch_init, HookType.AFTER),
        "sglang.srt.mem_cache.common.release_kv_cache": (_around_release_kv_cache, HookType.AROUND),
        # Backend-agnostic: every attention backend runs under RadixAttention.forward.
        "sglang.srt.layers.radix_attention.RadixAttention.forward": (_after_attention, HookType.AFTER),
        # GateSight's GDN signals: every GDN backend (ours on CPU, SGLang's on GPU) runs under it.
        "sglang.srt.layers.radix_linear_attention.RadixLinearAttention.forward": (_around_linear_attention, HookType.AROUND),
        # Qwen3.5's gated attention computes its output gate here (GateSight's layer budgets).
        "sglang.srt.models.qwen3_5.Qwen3_5AttentionDecoderLayer._prepare_qkv_gate": (_after_prepare_qkv_gate, HookType.AFTER),
        # Qwen3-Next's computes it here (CPU, CUDA) or in the fused gfx950 prologue; neither sees the
        # forward batch, so the gate waits for that layer's RadixAttention.forward (_after_attention).
        "sglang.srt.models.qwen3_next.Qwen3HybridAttentionDecoderLayer.forward_prepare_native": (
            _after_qwen3_next_prepare, HookType.AFTER),
        "sglang.srt.models.qwen3_next.Qwen3HybridAttentionDecoderLayer.forward_prepare_fused": (
            _after_qwen3_next_prepare, HookType.AFTER),
        # Per-layer lengths (PyramidKV, gate budgets) for whichever attention backend SGLang builds,
        # and no captured graph for a batch that needs them.
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup._build_full_attention_backend_from_str": (
            _after_build_attention_backend, HookType.AFTER),
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph": (
            _around_can_run_graph, HookType.AROUND),
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph": (
            _around_can_run_graph, HookType.AROUND),
        "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner.can_run_graph": (_around_can_run_graph, HookType.AROUND),
        # SGLang's idle leak check balances the pool against what the tree and
        # sessions hold; the store holds slots the same way a session does.
        "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver.session_held_tokens": (
            _after_session_held_tokens, HookType.AFTER),
    }
    for target, (hook, kind) in hooks.items():
        HookRegistry.register(target, hook, kind)
    _COMPACTION_TARGETS.extend(hooks)
    # Data parallelism: every routing method of SGLang's DP controller asks this first (its own
    # process, so not among the scheduler's targets above).
    HookRegistry.register(
        "sglang.srt.managers.data_parallel_controller.DataParallelController.maybe_external_dp_rank_routing",
        _around_dp_routing, HookType.AROUND,
    )


_COMPACTION_TARGETS: list[str] = []


def _after_scheduler_init(_result, scheduler, *_args, **_kwargs) -> None:
    global _RUNTIME
    config = config_of(scheduler.server_args)
    if config.enabled:
        from sglang.srt.plugins.hook_registry import HookRegistry

        # SGLang only logs a hook it could not apply; compaction without all of them would be wrong.
        missing = [t for t in _COMPACTION_TARGETS if t not in HookRegistry._patched]
        if missing:
            raise RuntimeError(f"sglang_kvx: SGLang hooks not applied: {', '.join(missing)}")
        from sglang_kvx.compact.attention import PerLayerLengths
        from sglang_kvx.compact.runtime import KvxRuntime

        _RUNTIME = KvxRuntime(scheduler, config)
        PerLayerLengths.masked_rows = _RUNTIME.masked_rows
        # SGLANG_KVX_GDN_SIGNALS=recompute takes the GPU route on CPU too (tests keep it honest).
        if _on_cpu_platform() and os.environ.get("SGLANG_KVX_GDN_SIGNALS") != "recompute":
            from sglang_kvx.models.gdn_backend import TorchGDNAttnBackend

            # Our GDN backend passes on the signals it computes; SGLang's kernels (GPU) get them
            # recomputed from the layer's inputs in _around_linear_attention instead.
            TorchGDNAttnBackend.signal_listener = _RUNTIME.capture_gdn_from_backend
            _RUNTIME.gdn_signals_from_backend = True


def _after_build_attention_backend(backend, *_args, model_runner=None, **_kwargs):
    """Every full-attention backend SGLang builds gets per-layer lengths (``compact/attention.py``)
    when compaction is on; MLA backends keep their own layout and stay as built (flat budgets only)."""
    if model_runner is None or not config_of(model_runner.server_args).enabled or model_runner.use_mla_backend:
        return backend
    from sglang_kvx.compact.attention import with_per_layer_lengths

    return with_per_layer_lengths(backend)


def _around_can_run_graph(original, graph_runner, forward_batch, *args, **kwargs):
    """A captured graph replays the backend's own kernels: a batch reading a compacted prefix with
    per-layer lengths runs eagerly instead."""
    if not original(graph_runner, forward_batch, *args, **kwargs):
        return False
    return _RUNTIME is None or not _RUNTIME.batch_needs_per_layer_lengths(forward_batch)


_AFFINITY = None  # the DP controller's ContextAffinity; False when compaction is off


def _around_dp_routing(original, controller, req):
    """Send a compacted context's children to the DP rank that holds it (``serve/affinity.py``)."""
    global _AFFINITY
    sampling_params = getattr(req, "sampling_params", None)
    if getattr(req, "routed_dp_rank", None) is None and sampling_params is not None and getattr(req, "input_ids", None):
        if _AFFINITY is None:
            from sglang_kvx.serve.affinity import ContextAffinity

            _AFFINITY = ContextAffinity() if config_of(controller.server_args).enabled else False
        if _AFFINITY is not False:
            rank = _AFFINITY.route(list(req.input_ids), marks_context(sampling_params), list(controller._active_workers))
            if rank is not None:
                req.routed_dp_rank = rank
    return original(controller, req)


def _around_init_next_round_input(original, req, tree_cache=None, cow_mamba=None):
    if _RUNTIME is None or tree_cache is None or not _RUNTIME.before_round(req):
        return original(req, tree_cache, cow_mamba)
    # A child: refresh its (rewritten) fill ids without touching the tree, take an
    # empty match at the root, then claim the stored rank slots as its protected prefix.
    from array import array

    from sglang.srt.mem_cache.common import match_kv_cache

    original(req, None, cow_mamba)
    match_kv_cache(req, tree_cache, array("q"), cow_mamba=False, max_prefix_len=0)
    num_slots = getattr(req, "_kvx_context").num_slots
    req.prefix_len = num_slots
    req.num_matched_prefix_tokens = num_slots
    req.kv.cache_protected_len = num_slots  # SGLang frees only what lies past it


def _around_prefix_device_indices(original, tree_cache, req):
    slots = _RUNTIME.child_prefix_slots(req) if _RUNTIME is not None else None
    return original(tree_cache, req) if slots is None else slots


def _after_alloc_for_extend(result, batch, *_args, **_kwargs):
    if _RUNTIME is not None:
        _RUNTIME.after_alloc(batch.reqs)
    return result


def _after_forward_batch_init(forward_batch, *_args, **_kwargs):
    if _RUNTIME is not None:
        _RUNTIME.shift_positions(forward_batch)
    return forward_batch


def _after_attention(output, layer, q, k, v, forward_batch, *args, **kwargs):
    if _RUNTIME is not None and _RUNTIME.captures:
        _RUNTIME.capture_attention(layer, q, forward_batch)
        _RUNTIME.capture_pending_output_gate(layer.layer_id, forward_batch)
    return output


def _around_linear_attention(original, layer, forward_batch, *args, **kwargs):
    if _RUNTIME is not None and _RUNTIME.captures and not _RUNTIME.gdn_signals_from_backend:
        mixed_qkv, a, b = _linear_attention_inputs(args, kwargs)
        _RUNTIME.capture_gdn(layer, forward_batch, mixed_qkv, a, b)
    return original(layer, forward_batch, *args, **kwargs)


def _linear_attention_inputs(args, kwargs):
    names = ("mixed_qkv", "a", "b")
    values = dict(zip(names, args))
    values.update({k: kwargs[k] for k in names if k in kwargs})
    return values["mixed_qkv"], values["a"], values["b"]


def _after_prepare_qkv_gate(result, decoder_layer, positions, hidden_states, forward_batch, *args, **kwargs):
    if _RUNTIME is not None and _RUNTIME.captures and result[3] is not None:
        _RUNTIME.capture_output_gate(decoder_layer.attn.layer_id, result[3], forward_batch)
    return result


def _after_qwen3_next_prepare(result, decoder_layer, *args, **kwargs):
    # (q, k, v, gate), or None when the fused prologue declines and the native one runs instead.
    if _RUNTIME is not None and _RUNTIME.captures and result is not None and result[3] is not None:
        _RUNTIME.pending_output_gates[decoder_layer.attn.layer_id] = result[3]
    return result


def _around_release_kv_cache(original, req, tree_cache, *args, **kwargs):
    if _RUNTIME is not None:
        _RUNTIME.before_release(req)
    return original(req, tree_cache, *args, **kwargs)


def _after_session_held_tokens(held, *_args, **_kwargs):
    return held + (_RUNTIME.held_slots() if _RUNTIME is not None else 0)


def _around_flush_cache(original, scheduler, *args, **kwargs):
    result = original(scheduler, *args, **kwargs)
    allocator = scheduler.token_to_kv_pool_allocator
    if _RUNTIME is not None and allocator.available_size() == scheduler.max_total_num_tokens:
        _RUNTIME.forget_all()  # SGLang cleared every pool: the store's slots went with them
    return result


# --- stats -----------------------------------------------------------------------


def _after_get_internal_state(result, scheduler, *_args, **_kwargs):
    from sglang_kvx.serve.stats import scheduler_stats

    result.internal_state["kvx"] = scheduler_stats(scheduler, config_of(scheduler.server_args), _RUNTIME)
    return result


def _register_http_routes() -> None:
    from sglang.srt.entrypoints import http_server

    from sglang_kvx.serve.routes import add_routes

    add_routes(http_server.app, http_server.get_global_state)
