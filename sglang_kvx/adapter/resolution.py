"""What the plugin turns off of SGLang's defaults, through SGLang's own resolution (``declare_resolution``).

SGLang resolves its server arguments once per launch (``ServerArgs.resolve_once``); a plugin may wrap a
named step (``register_resolution_hook``). On a GPU, SGLang's defaults serve every mode of the plugin
except these, which the plugin turns off by name, one log line each, right after the step that decided
them (``docs/deployment.md`` has the whole table, checked by ``tests/test_gpu_defaults.py`` under a
stand-in H100):

- CUDA graphs, with ``kvx_gated`` or ``kvx_torch_native`` attention: both compute attention in torch
  with per-row Python (SGLang's ``torch_native``, which they extend, cannot be captured, and SGLang turns
  graphs off for that name only). Under the CPU graph emulation ``kvx_torch_native`` stands in for a
  capturable backend and keeps them (``graph_replay.py``).
- CUDA graphs, with block-sparse attention (``--kvx-sparse-attention``): every batch plans its blocks
  on the host and runs the kernel layer's ops, so no batch would replay a graph.
- ``extra_buffer`` GDN state caching (and with it the overlap scheduler, which SGLang pairs with it),
  on hybrid GDN models: the plugin restores GDN states at request boundaries (a compacted context's
  children, a decode step's re-run) and has run only with ``no_buffer``, as SGLang pairs it, with overlap
  off. Only where SGLang chose it itself (``--mamba-radix-cache-strategy auto``).
"""

from __future__ import annotations

import logging

from sglang_kvx.adapter.graph_replay import emulation_asked
from sglang_kvx.adapter.server_config import config_of, on_cpu_platform
from sglang_kvx.config import GATED_ATTENTION_BACKEND

logger = logging.getLogger(__name__)

TORCH_ATTENTION = ("kvx_torch_native", GATED_ATTENTION_BACKEND)


def register_resolution() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_attention_backend_compatibility")(_after_attention_backend)
    register_resolution_hook("handle_model_specific_adjustments")(_after_model_adjustments)


def _after_attention_backend(server_args, previous) -> None:
    previous(server_args)
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolving_view

    view = resolving_view(server_args)
    torch_attention = sorted({b for b in attention_backends_of(view) if b in TORCH_ATTENTION})
    if emulation_asked() and on_cpu_platform():
        torch_attention = [b for b in torch_attention if b != "kvx_torch_native"]  # it stands in for FA3 there
    if torch_attention:
        _graphs_off(server_args, f"the {'/'.join(torch_attention)} attention backend computes attention in torch with "
                                 f"per-row Python, which a captured graph cannot hold (as SGLang does for torch_native)")
    elif config_of(server_args).sparse_budget:
        _graphs_off(server_args, "block-sparse attention (--kvx-sparse-attention) plans every batch's blocks on the "
                                 "host and runs its own ops, so no batch could replay a graph")


def _graphs_off(server_args, why: str) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    graphs = resolving_view(server_args).cuda_graph_config
    if graphs is None or (graphs.decode.backend == Backend.DISABLED and graphs.prefill.backend == Backend.DISABLED):
        return
    for phase in (Phase.DECODE, Phase.PREFILL):
        graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
    declare_resolution(server_args, "sglang_kvx:graphs_off", cuda_graph_config=graphs)
    logger.info("sglang_kvx: CUDA graphs off (decode and prefill): %s", why)


def _after_model_adjustments(server_args, previous) -> None:
    previous(server_args)
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    view = resolving_view(server_args)
    if (not config_of(server_args).enabled or not view.uses_mamba_radix_cache
            or view.mamba_radix_cache_strategy != "extra_buffer"
            or server_args.mamba_radix_cache_strategy not in (None, "auto")):  # the raw input: the user's choice stands
        return
    declare_resolution(server_args, "sglang_kvx:gdn_states", mamba_radix_cache_strategy="no_buffer",
                       disable_overlap_schedule=True)
    logger.info("sglang_kvx: GDN radix caching no_buffer, overlap scheduler off (SGLang pairs them): the plugin "
                "restores GDN states at request boundaries and has not run with extra_buffer's state snapshots")
