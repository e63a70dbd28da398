"""A kernel that passes its start-up check and fails inside a forward, injected into a served CPU server
from outside the package (issue #54 item 5): ``--kvx-policy-modules throwaway_raising_op`` registers it as
the ``prefix_attention`` implementation ``raising`` and ``SGLANG_KVX_OPS_IMPL=prefix_attention=raising``
chooses it (the masked path's op, which a child's question over a per-head context still runs). It answers as the torch reference on the warm-up's tiny pool and raises on the server's
(as a kernel can on a shape its check did not cover); the request it fails in must still be answered,
by the reference, and the scheduler live on.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.dispatch import register_implementation
from sglang_kvx.ops.prefix_attention import prefix_cells_attention_reference

NAME = "raising"
TINY_POOL = 1024  # the warm-up's pools are far smaller, every served pool larger


def raising_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, *args):
    if k_cache.shape[0] > TINY_POOL:
        raise RuntimeError("an injected kernel failure (tests/throwaway_raising_op.py)")
    return prefix_cells_attention_reference(q, k_cache, *args)


register_implementation("prefix_attention", NAME, raising_prefix_attention)
