"""A kernel that passes its start-up check and fails inside a forward, injected into a served CPU server
from outside the package (issue #54 item 5): ``--kvx-policy-modules throwaway_raising_op`` registers it as
the ``state_snapshot`` implementation ``raising`` and ``SGLANG_KVX_OPS_IMPL=state_snapshot=raising``
chooses it (the op a decode step's re-run uses to snapshot and restore recurrent states, inside the
forward). It copies as the reference does on the warm-up's tiny states and raises on the server's (as
a kernel can on a shape its check did not cover); the request it fails in must still be answered, by
the reference, and the scheduler live on.
"""

from __future__ import annotations

import torch

from sglang_kvx.ops.dispatch import register_implementation

NAME = "raising"
TINY_SLOTS = 16  # the warm-up's states hold 9 slots, every served state pool more


def raising_state_snapshot(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, scatter: bool) -> None:
    """The op's kernel contract: rows of [outer, S, inner] views, gathered (``dst[:, k] = src[:, index[k]]``)
    or scattered (``dst[:, index[k]] = src[:, k]``)."""
    state = dst if scatter else src
    if state.shape[1] > TINY_SLOTS:
        raise RuntimeError("an injected kernel failure (tests/throwaway_raising_op.py)")
    if scatter:
        dst.index_copy_(1, index, src)
    else:
        torch.index_select(src, 1, index, out=dst)


register_implementation("state_snapshot", NAME, raising_state_snapshot)
