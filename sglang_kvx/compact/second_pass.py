"""KVzip's second pass inside SGLang: the context-reconstruction requests a kvzip parent needs.

KVzip scores a context by what the model attends to while repeating it, so a kvzip parent is
compacted in two steps instead of one:
  1. at the parent's release its full KV stays in its own slots (held here, counted by SGLang's
     leak check like the store's) with its GDN states snapshotted, and one internal request per
     reconstruction chunk is queued through SGLang's own ``handle_generate_request``: prompt ids
     = context + KVzip's repeat prompt + the chunk. Each pass is a child of the full context
     (the store's child machinery: prefix slots, GDN snapshot restored), so only the pass tokens
     are prefilled, and it never reaches the client (``finished_output``);
  2. as each pass leaves, its captured queries and the keys of [context ; pass] fold into the
     score (``policies.kvzip.accumulate_reconstruction_attention``); after the last pass the
     runtime selects and compacts within the held slots and frees the rest.
Requests for the context that arrive before the passes finish are served from the full cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_kvx.store import CompactedContext

logger = logging.getLogger(__name__)

PASS_RID_PREFIX = "kvx-kvzip-pass-"
_ids = itertools.count()


@dataclass
class KVzipJob:
    context: CompactedContext  # the full context (k_max = n, every layer keeps every position)
    settings: tuple[str, float, int, str]
    passes: dict[str, tuple[int, int]]  # rid -> (start, end) of its chunk
    totals: list[torch.Tensor]  # per attention layer [kv_heads, n]: running max of reconstruction attention
    started: float = field(default_factory=time.perf_counter)
    accumulate_s: float = 0.0
    failed: str | None = None


def pass_length(context_len: int, prompt_ids: tuple[list[int], list[int], list[int]], protected: int) -> int:
    """Tokens of the longest reconstruction pass of a context (the child must fit the context length)."""
    from sglang_kvx.policies.kvzip import CHUNK_SIZE, PREVIOUS_TAIL

    prompt, continuation, postfix = prompt_ids
    chunk = min(CHUNK_SIZE, max(0, context_len - protected))
    lead = max(len(prompt), len(continuation) + PREVIOUS_TAIL)
    return lead + len(postfix) + chunk


def make_pass_request(rid: str, input_ids: list[int]):
    """An internal prefill-only request, shaped like the tokenizer manager's."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sampling = SamplingParams(max_new_tokens=0, custom_params={"kvx": {"compact": False}})
    sampling.normalize(None)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=array("q", input_ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sampling,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )


def new_job_id() -> int:
    return next(_ids)


def full_context(context_ids: tuple[int, ...], settings: tuple[str, float, int, str], slots: torch.Tensor,
                 num_layers: int, gdn_snapshot: Any) -> CompactedContext:
    policy, keep_fraction, protected, allocation = settings
    n = len(context_ids)
    return CompactedContext(
        context_ids=context_ids, policy=policy, keep_fraction=keep_fraction, protected_prefix_len=protected,
        allocation=allocation, slots=slots, kept_per_layer=[n] * num_layers, gdn_snapshot=gdn_snapshot,
    )
