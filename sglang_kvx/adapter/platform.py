"""A pure-torch CPU platform for SGLang, as an out-of-tree platform plugin.

SGLang's in-tree CPU route needs a CPU build of sgl-kernel that PyPI does not
ship. Being out-of-tree keeps ``is_cpu()`` false, so nothing imports sgl_kernel;
every op falls back to its torch-native path, and GDN layers use our own
pure-torch backend (``sglang_kvx.adapter.gdn_backend``).
"""

from __future__ import annotations

import logging
import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from sglang_kvx.adapter.graph_replay import emulation_asked

logger = logging.getLogger(__name__)

CPU_OVERLAP = "SGLANG_KVX_CPU_OVERLAP"

class KvxCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Torch-native attention and sampling, no graphs, no Triton, gloo collectives."""

    _enum = PlatformEnum.OOT
    # Decode graphs are captured only where the platform says it can: under the emulation, emulated ones.
    capabilities = PlatformCapabilities(graph_capture=emulation_asked())

    def get_default_attention_backend(self) -> str:
        # SGLang's torch-native attention, plus per-layer lengths for compacted prefixes
        # (registered by the sglang_kvx plugin; identical to torch_native otherwise).
        return "kvx_torch_native"

    def apply_server_args_defaults(self, server_args) -> None:
        # Defaults only: values the operator passed on the command line win.
        if server_args.sampling_backend is None:
            server_args.sampling_backend = "pytorch"
        # CPU matmuls in float16 are emulated and slow; float32 is exact and fast here.
        if server_args.dtype == "auto":
            server_args.dtype = "float32"
        # Mamba/GDN state snapshots inside the radix cache ("extra_buffer") need
        # device kernels; "no_buffer" caches GDN states at request boundaries.
        if server_args.mamba_radix_cache_strategy == "auto":
            server_args.mamba_radix_cache_strategy = "no_buffer"
        # GDN conv states default to bfloat16 (an env var, read in the scheduler
        # process, which inherits ours): with float32 weights that alone puts
        # decode 1e-2 off in log-probability. Match the model dtype instead.
        if server_args.dtype == "float32":
            os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")
        # SGLang sizes the GDN state pool from free memory: on a 24 GiB machine
        # that is ~140K slots, 7 GB and 20 s of start-up for a tiny model.
        if server_args.max_mamba_cache_size is None:
            server_args.max_mamba_cache_size = 256
        # The overlap scheduler hides GPU latency behind CPU scheduling; with the
        # CPU doing both, it only adds work. SGLANG_KVX_CPU_OVERLAP=1 keeps it (the
        # tests run GPU's scheduling order this way).
        if os.environ.get(CPU_OVERLAP) != "1":
            server_args.disable_overlap_schedule = True

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"
