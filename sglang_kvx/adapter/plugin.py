"""The plugin: what SGLang calls into, registered when SGLang loads its plugins.

SGLang calls :func:`load` (entry point ``sglang.srt.plugins``) early in every
process it starts: the launcher, the scheduler, the detokenizer. Everything
here goes through SGLang's own extension points (``contract.py`` lists every
target and checks it against the installed SGLang):

- ``HookRegistry`` hooks on the argument parser (our ``--kvx-*`` flags) and on
  ``ServerArgs.from_cli_args`` (validation before any model loads);
- ``register_resolution_hook`` for CPU-platform defaults;
- ``register_attention_backend`` for ``kvx_torch_native`` (torch attention with
  per-layer lengths of compacted prefixes), and an AFTER hook on SGLang's backend
  factory that gives any other full-attention backend the same per-layer lengths;
- on the CPU platform only, a class swap of ``GDNAttnBackend`` for the pure-torch
  GDN backend and torch stand-ins for three Triton calls (no GDN registry exists);
- in the HTTP process, an AFTER hook on the tokenizer manager's request validation
  (``door.py``: bad ``custom_params.kvx``, token ids outside the vocabulary, empty
  prompts and internal request ids get a 400 before reaching the scheduler);
- in scheduler processes, narrow hooks around the functions that decide a
  request's prefix, positions and release (``scheduler_hooks.py``);
- an AFTER hook on ``Scheduler.get_internal_state`` that reports our stats
  from SGLang's real pools, and FastAPI routes on SGLang's own app.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Any

from sglang_kvx.adapter.server_config import attach_config, config_of, on_cpu_platform
from sglang_kvx.config import DTYPE_BYTES, KvxConfigError, add_cli_args, build_config
from sglang_kvx.schema import FLAG_SETTINGS

logger = logging.getLogger(__name__)



def load() -> None:
    """Entry point of SGLang's ``sglang.srt.plugins`` group."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", _after_get_internal_state, HookType.AFTER
    )
    _register_gated_models()
    _register_platform_defaults()
    from sglang_kvx.adapter.resolution import register_resolution

    register_resolution()  # what the plugin turns off of SGLang's GPU defaults, by name
    _register_attention_backend()
    _register_gdn_backend()
    _register_graph_emulation()
    if multiprocessing.parent_process() is None:
        _register_cpu_forkserver()
        _register_http_routes()
        from sglang_kvx.adapter.door import register_door

        register_door()
    else:
        from sglang_kvx.adapter.scheduler_hooks import register_scheduler_hooks

        register_scheduler_hooks()


# --- flags -----------------------------------------------------------------


def _after_add_cli_args(_result: Any, parser) -> None:
    add_cli_args(parser)


def _context_tokens(server_args) -> int | None:
    """The longest prompt this server takes: its context length, within its pool when that is set."""
    limits = [int(v) for v in (server_args.context_length, server_args.max_total_tokens) if v]
    return min(limits) if limits else None


def _kv_dtype_bytes(server_args) -> float | None:
    """A KV value's bytes as the pool will hold it (None: decided from weights SGLang has not read yet)."""
    kv = str(server_args.kv_cache_dtype or "auto")
    if kv.startswith("fp8") or kv == "int8":
        return 1
    if kv.startswith("fp4"):
        return 0.5
    return DTYPE_BYTES.get(kv if kv != "auto" else str(server_args.dtype or "auto"))  # None: the checkpoint's dtype


def _around_from_cli_args(original, cls, args, *rest, **kwargs):
    server_args = original(cls, args, *rest, **kwargs)
    try:
        config = build_config(
            model_path=getattr(args, "model_path", None), tp_size=int(server_args.tp_size or 1),
            page_size=int(server_args.page_size or 1), attention_backend=getattr(args, "attention_backend", None),
            context_tokens=_context_tokens(server_args), kv_dtype_bytes=_kv_dtype_bytes(server_args),
            **{setting.name: getattr(args, setting.dest, setting.default) for setting in FLAG_SETTINGS},
        )
    except KvxConfigError as exc:
        # One line, argparse-style, before anything heavy starts.
        print(f"sglang-kvx: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    attach_config(server_args, config)
    return server_args


# --- CPU platform defaults -----------------------------------------------------


def _register_platform_defaults() -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    @register_resolution_hook("handle_missing_default_values")
    def _cpu_device_default(server_args, previous):
        # SGLang's own default asks an out-of-tree platform for a torch.device
        # and then splits it like a string; name the device first.
        from sglang.srt.platforms import current_platform

        from sglang_kvx.config import GATED_ATTENTION_BACKEND as KVX_GATED_ATTENTION
        from sglang_kvx.adapter.platform import KvxCpuPlatform
        from sglang_kvx.config import model_traits

        view = resolving_view(server_args)
        if view.attention_backend is None and _is_local_dir(server_args.model_path):
            traits = model_traits(server_args.model_path)
            if traits is not None and traits.gated_attention:  # the learned-gate family's own attention
                declare_resolution(server_args, "sglang_kvx:gated_model", attention_backend=KVX_GATED_ATTENTION)
        if isinstance(current_platform, KvxCpuPlatform):
            view = resolving_view(server_args)
            if view.device is None:
                declare_resolution(server_args, "sglang_kvx:cpu_platform", device="cpu")
            # SGLang picks torch_native for device "cpu" before asking the platform.
            if view.attention_backend is None:
                declare_resolution(server_args, "sglang_kvx:cpu_platform", attention_backend=KVX_TORCH_ATTENTION)
            _default_cpu_thread_binding(server_args)
        previous(server_args)


def _is_local_dir(path) -> bool:
    return bool(path) and os.path.isdir(os.path.expanduser(str(path)))


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

    from sglang_kvx.config import GATED_ATTENTION_BACKEND as KVX_GATED_ATTENTION

    if KVX_TORCH_ATTENTION in ATTENTION_BACKENDS:
        return
    add_attention_backend_choices([KVX_TORCH_ATTENTION, KVX_GATED_ATTENTION])

    @register_attention_backend(KVX_GATED_ATTENTION)
    def _create_gated(runner):
        from sglang_kvx.adapter.gated_backend import KvxGatedAttnBackend

        return KvxGatedAttnBackend(runner)

    @register_attention_backend(KVX_TORCH_ATTENTION)
    def _create(runner):
        from sglang_kvx.adapter.attention import KvxTorchNativeAttnBackend

        return KvxTorchNativeAttnBackend(runner)


def _register_gated_models() -> None:
    """The learned-gate family: its config class with transformers (every process reads configs)
    and, in scheduler processes, its model class with SGLang's model registry."""
    from sglang_kvx.models.gated import register

    register()
    if multiprocessing.parent_process() is not None:
        from sglang.srt.models.registry import ModelRegistry

        ModelRegistry.register("sglang_kvx.adapter.models", overwrite=True)


def _register_gdn_backend() -> None:
    """On the CPU platform, serve GDN layers with our pure-torch backend.

    SGLang has no registry for GDN kernels: its hybrid wrapper builds
    ``gdn_backend.GDNAttnBackend`` by name, so we replace that one class, and
    the few Triton functions in CPU_STANDINS, only when the CPU platform is
    active. GPU machines keep SGLang's own kernels untouched.
    """
    if not on_cpu_platform() or multiprocessing.parent_process() is None:
        return  # model code runs only in scheduler subprocesses
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_kvx.adapter import cpu_standins
    from sglang_kvx.adapter.gdn_backend import TorchGDNAttnBackend

    from sglang_kvx.adapter.contract import CPU_STANDINS, GDN_BACKEND_CLASS, GDN_LAYER_INIT

    HookRegistry.register(GDN_BACKEND_CLASS, TorchGDNAttnBackend, HookType.REPLACE)
    for target, name in CPU_STANDINS.items():
        HookRegistry.register(target, getattr(cpu_standins, name), HookType.REPLACE)
    HookRegistry.register(GDN_LAYER_INIT, _around_gdn_layer_init_on_cpu, HookType.AROUND)


def _register_graph_emulation() -> None:
    """``SGLANG_KVX_EMULATE_GRAPHS=1`` on the CPU platform: SGLang's graph runners, emulated
    (``graph_replay.py``); scheduler processes only (graphs are captured there)."""
    from sglang_kvx.adapter.graph_replay import emulation_asked

    if not emulation_asked() or not on_cpu_platform() or multiprocessing.parent_process() is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_kvx.adapter import graph_runners
    from sglang_kvx.adapter.contract import EMULATION_HOOKS

    for target, (name, kind) in EMULATION_HOOKS.items():
        HookRegistry.register(target, getattr(graph_runners, name), HookType(kind))


CPU_FORKSERVER = "SGLANG_KVX_CPU_FORKSERVER"


def _register_cpu_forkserver() -> None:
    """``SGLANG_KVX_CPU_FORKSERVER=1`` on the CPU platform, in the launcher: SGLang's child processes start
    from one forkserver that imported the scheduler's and detokenizer's modules once, instead of each
    spawned child importing SGLang (~13 CPU-s each on this machine's cores). What a child runs is the
    same: its target and pickled arguments, in a process whose modules were imported fresh (the
    forkserver's, not the launcher's state). The test suite's servers start this way; SGLang's own spawn
    stays the default, and the launcher's own tests (test_cli, test_docs) start with it."""
    if os.environ.get(CPU_FORKSERVER) != "1" or not on_cpu_platform():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_kvx.adapter.contract import FORKSERVER_HOOK

    HookRegistry.register(FORKSERVER_HOOK, _after_set_envs_and_config, HookType.AFTER)


def _after_set_envs_and_config(_result, *_args, **_kwargs) -> None:
    """SGLang has just set the start method to spawn: the forkserver instead, its modules preloaded."""
    from sglang_kvx.adapter.contract import FORKSERVER_PRELOAD

    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["sglang_kvx.adapter.forkserver_imports_begin", *FORKSERVER_PRELOAD,
                                            "sglang_kvx.adapter.forkserver_imports_end"])
    logger.info("sglang_kvx: child processes start from a forkserver (%s=1)", CPU_FORKSERVER)


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


# --- stats -----------------------------------------------------------------------


def _after_get_internal_state(result, scheduler, *_args, **_kwargs):
    from sglang_kvx.adapter.forward import runtime_of
    from sglang_kvx.adapter.stats import scheduler_stats

    result.internal_state["kvx"] = scheduler_stats(
        scheduler, config_of(scheduler.server_args), runtime_of(scheduler.req_to_token_pool)
    )
    return result


def _register_http_routes() -> None:
    from sglang.srt.entrypoints import http_server

    from sglang_kvx.serve.routes import add_routes, scrub_validation_errors

    add_routes(http_server.app, http_server.get_global_state)
    scrub_validation_errors(http_server.app)
