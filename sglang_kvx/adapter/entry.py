"""Entry point of SGLang's ``sglang.srt.platforms`` group.

Kept free of SGLang imports: SGLang resolves its platform while importing its
own platform package, so this module must load without touching it.
"""

from __future__ import annotations

import os

CPU_PLATFORM = "sglang_kvx.adapter.platform.KvxCpuPlatform"


def activate() -> str | None:
    """Claim the machine for the pure-torch CPU platform when it has no GPU.

    ``SGLANG_KVX_CPU=1`` forces the CPU platform on a GPU machine; ``=0`` declines it.
    """
    forced = os.environ.get("SGLANG_KVX_CPU")
    if forced == "0":
        return None
    if forced == "1":
        return CPU_PLATFORM
    import torch

    return None if torch.cuda.is_available() else CPU_PLATFORM
