"""Captured-graph replay, emulated on CPU: SGLang's GPU execution model, checkable without a GPU.

On CUDA SGLang captures a decode graph (the whole forward) and a breakable prefill graph (the
decoder stack, split at the calls it marks ``@eager_on_graph``: the attention and GDN backends'
forwards) and replays them: during a replay no Python runs but those marked calls -- not the
plugin's hooks, not torch module hooks, not the attention backends' Python in a decode graph.
``SGLANG_KVX_EMULATE_GRAPHS=1`` on the CPU platform stands in for that, and says exactly what it
reproduces:

- *which batches replay*: SGLang's own ``can_run_graph`` (decode: ``DecodeCudaGraphRunner``'s; prefill:
  ``PrefillCudaGraphRunner``'s ``can_replay_locally``), with the plugin's ``around_can_run_graph`` around
  it, over the capture sizes SGLang resolves (decode batch sizes; prefill token buckets up to
  ``--chunked-prefill-size``); SGLang's own ``capture_prefill_graph`` decides whether a model gets a
  prefill graph at all;
- *what a replay refuses*: the captured hidden-state mode (``_validate_capture_hidden_mode``: a
  batch asking for more raises, as SGLang's ``load_batch`` does on CUDA);
- *what runs during a replay*: the model's forward with SGLang's breakable-graph flags set (so its
  layers take their graph paths and call the eager bodies), every hook the plugin registered passing
  straight through and every torch module hook of the model removed; in a decode replay the
  attention backends take the path they took when capturing on dummy rows (``on_capture_path``),
  under the attention graph variant SGLang's runner selects for the batch (``graph_tables.py``: the
  page-table variant's static tables are filled first, as SGLang prepares a replay out of the graph);
- *what capture asks of the backend*: ``init_cuda_graph_state`` at start (torch-native backends
  raise there, as on CUDA; ``kvx_torch_native`` stands in for a capturable backend such as FA3
  here and records nothing).

Not reproduced: the static buffers' addresses (a replay reads the live batch), CUDA streams, and
the kernels' own numerics (the replay computes what the eager forward computes).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_KVX_EMULATE_GRAPHS"
DECODE, PREFILL = "decode", "prefill"

_replaying: ContextVar[str | None] = ContextVar("kvx_graph_replay", default=None)


def emulation_asked() -> bool:
    return os.environ.get(ENV) == "1"


def replaying() -> str | None:
    """``DECODE`` or ``PREFILL`` while an emulated graph replays, else None."""
    return _replaying.get()


def on_capture_path(tensor: torch.Tensor) -> bool:
    """Whether attention code runs as a graph records it, on dummy rows: a CUDA capture, or an emulated
    decode replay (which replays what the capture recorded). The plugin's per-row paths are off then."""
    return _replaying.get() == DECODE or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def silent_in_replay(hook: Callable, kind: str) -> Callable:
    """``hook`` as registered with SGLang, passing straight through while a graph replays (a replay
    runs no Python hook): an AFTER hook returns the result, an AROUND hook calls the original."""

    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _replaying.get() is None:
            return hook(*args, **kwargs)
        if kind == "after":
            return args[0]
        if kind == "around":
            return args[0](*args[1:], **kwargs)
        return hook(*args, **kwargs)

    return wrapper


@contextmanager
def replay_scope(kind: str, model: torch.nn.Module) -> Iterator[None]:
    """Run the enclosed forward as a replay of ``kind``: the plugin's hooks pass through and the model's
    torch module hooks are off (restored after)."""
    hooked = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()
              if m._forward_pre_hooks or m._forward_hooks]
    for module, _, _ in hooked:
        module._forward_pre_hooks, module._forward_hooks = OrderedDict(), OrderedDict()
    token = _replaying.set(kind)
    try:
        yield
    finally:
        _replaying.reset(token)
        for module, pre, post in hooked:
            module._forward_pre_hooks, module._forward_hooks = pre, post
