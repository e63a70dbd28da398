"""A pure-torch CPU platform for SGLang, as an out-of-tree platform plugin.

SGLang's in-tree CPU route needs a CPU build of sgl-kernel that PyPI does not
ship. Being out-of-tree keeps ``is_cpu()`` false, so nothing imports sgl_kernel;
every op falls back to its torch-native path, and GDN layers use our own
pure-torch backend (``sglang_kvx.models.gdn_backend``).
"""

from __future__ import annotations

import logging

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger(__name__)

class KvxCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Torch-native attention and sampling, no graphs, no Triton, gloo collectives."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def apply_server_args_defaults(self, server_args) -> None:
        # SGLang's device default asks the platform for a torch.device and then
        # treats it as a string; naming the device here keeps it a string.
        if server_args.device is None:
            server_args.device = "cpu"
        if server_args.sampling_backend is None:
            server_args.sampling_backend = "pytorch"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"
