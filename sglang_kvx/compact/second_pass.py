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

from sglang_kvx.compact.layout import fold_layers
from sglang_kvx.config import KvxConfigError
from sglang_kvx.select import choose_keep_set
from sglang_kvx.store import CompactedContext

logger = logging.getLogger(__name__)

PASS_RID_PREFIX = "kvx-kvzip-pass-"
_ids = itertools.count()


@dataclass
class KVzipJob:
    context: CompactedContext  # the full context (S = n, every layer keeps every position)
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
        allocation=allocation, slots=slots, kept_per_layer=[n] * num_layers, layout=fold_layers([n] * num_layers),
        prefix_cells=[None] * num_layers, gdn_snapshot=gdn_snapshot,
    )


class KVzipSecondPass:
    """The jobs of one scheduler's compaction runtime ``rt``: start at a kvzip parent's release,
    fold each pass in as it leaves, compact after the last one."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self.jobs: dict[str, KVzipJob] = {}  # pass request id -> its job
        self._prompt: tuple[list[int], list[int], list[int]] | None = None

    def pass_length(self, context_len: int, protected: int) -> int:
        return pass_length(context_len, self.prompt(), protected)

    def held_slots(self) -> int:
        jobs = {id(job): job for job in self.jobs.values()}
        return sum(job.context.num_slots for job in jobs.values())

    def prompt(self) -> tuple[list[int], list[int], list[int]]:
        if self._prompt is None:
            from sglang_kvx.policies.kvzip import reconstruction_prompt_ids

            tokenizer = getattr(self.rt.scheduler, "tokenizer", None)
            if tokenizer is None:
                raise KvxConfigError("kvx policy 'kvzip' needs the server's tokenizer (do not pass --skip-tokenizer-init)")
            self._prompt = reconstruction_prompt_ids(tokenizer)
        return self._prompt

    def start(self, req, settings: tuple[str, float, int, str]) -> None:
        """Hold the parent's full context and queue its reconstruction passes."""
        from sglang_kvx.policies.kvzip import reconstruction_inputs

        context_ids = tuple(int(t) for t in req.origin_input_ids)
        n = len(context_ids)
        row = self.rt.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.long)
        if int(req.kv.cache_protected_len) == 0:
            slots = row.clone()
            req.kv.cache_protected_len = n  # SGLang frees none of them: they are the job's now
        else:  # part of the context was a radix-cache hit (the tree's slots): take a copy
            slots = self.rt.allocator.alloc(n)
            if slots is None:
                self.rt.skipped_no_room += 1
                logger.warning("sglang_kvx: no room to hold a %d-token context for kvzip; it stays uncompacted", n)
                return
            slots = slots.to(torch.long)
            for layer_id in self.rt.attention_layer_ids:
                for buffer in (self.rt.kv_pool.get_key_buffer(layer_id), self.rt.kv_pool.get_value_buffer(layer_id)):
                    buffer[slots] = buffer[row]
        req.skip_radix_cache_insert = True
        snapshot = self.rt.mamba_pool.get_cpu_copy(self.rt.mamba_slot(req)) if self.rt.mamba_pool is not None else None
        context = full_context(context_ids, settings, slots, len(self.rt.attention_layer_ids), snapshot)
        job = KVzipJob(context=context, settings=settings, passes={},
                       totals=[torch.zeros(self.rt.num_kv_heads, n) for _ in self.rt.attention_layer_ids])
        job_id = new_job_id()
        passes = reconstruction_inputs(list(context_ids), *self.prompt(), protected_prefix_len=settings[2])
        requests = []
        for i, (start, end, ids) in enumerate(passes):
            rid = f"{PASS_RID_PREFIX}{job_id}-{i}"
            job.passes[rid] = (start, end)
            self.jobs[rid] = job
            requests.append(make_pass_request(rid, list(context_ids) + ids))
        for pass_request in requests:
            self.rt.scheduler.handle_generate_request(pass_request)
        logger.info("sglang_kvx: kvzip holds a %d-token context for %d reconstruction pass(es)", n, len(passes))

    def finish_pass(self, req) -> None:
        """A reconstruction pass leaves: fold its attention into the job's scores (its KV is still in the pool)."""
        job = self.jobs.pop(req.rid)
        row_index = int(req.kv.req_pool_idx)
        capture = self.rt.captures.pop(row_index, None)
        start, end = job.passes.pop(req.rid)
        from sglang_kvx.compact.runtime import is_aborted

        if is_aborted(req) or not req.finished() or not req.kv.holds_kv or capture is None or len(capture.pass_queries) != len(self.rt.attention_layer_ids):
            job.failed = job.failed or f"reconstruction pass {req.rid} did not complete"
        else:
            t0 = time.perf_counter()
            from sglang_kvx.policies.kvzip import accumulate_reconstruction_attention

            total_len = len(req.origin_input_ids)
            row = self.rt.req_to_token_pool.req_to_token[row_index, :total_len].to(torch.long)
            for layer, layer_id in enumerate(self.rt.attention_layer_ids):
                keys = self.rt.kv_pool.get_key_buffer(layer_id)[row].transpose(0, 1).float()  # [Hkv, n + m, D]
                queries = torch.cat(capture.pass_queries[layer]).transpose(0, 1)  # [Hq, m, D]
                accumulate_reconstruction_attention(job.totals[layer], queries, keys, start, end,
                                                    protected_prefix_len=job.settings[2], scaling=capture.scaling[layer])
            job.accumulate_s += time.perf_counter() - t0
        if not job.passes:
            self._complete(job)

    def _complete(self, job: KVzipJob) -> None:
        held = job.context.slots
        if job.failed is not None:
            self.rt.allocator.free(held)
            self.rt.failed.append(job.failed)
            logger.error("sglang_kvx: kvzip compaction failed (%s); the context stays uncompacted", job.failed)
            return
        policy, keep_fraction, protected, allocation = job.settings
        t0 = time.perf_counter()
        signals = self.rt.read_signals(held, protected)
        signals.reconstruction_attention = job.totals
        keep = choose_keep_set(self.rt._policy(policy), signals, keep_fraction, allocation)
        t1 = time.perf_counter()
        layout = fold_layers(keep.kept_per_layer, fold=self.rt.fold_layers)
        slots = held[: layout.num_slots].clone()
        self.rt.gather_kept(signals, slots, keep, layout)
        if layout.num_slots < len(held):
            self.rt.allocator.free(held[layout.num_slots :])
        context = CompactedContext(
            context_ids=job.context.context_ids, policy=policy, keep_fraction=keep_fraction, protected_prefix_len=protected,
            allocation=allocation,
            slots=slots, kept_per_layer=keep.kept_per_layer, layout=layout, prefix_cells=self.rt.prefix_cells(slots, layout),
            keep_positions=[p.cpu() for p in keep.positions],
            gdn_snapshot=job.context.gdn_snapshot,
            timings={
                "second_pass_s": t0 - job.started,  # queueing + prefill of the reconstruction passes
                "accumulate_s": job.accumulate_s,
                "score_select_s": t1 - t0,
                "compact_s": time.perf_counter() - t1,
                "bytes_moved": sum(keep.kept_per_layer) * self.rt.bytes_per_entry,
            },
        )
        self.rt.store.add(context)
        logger.info("sglang_kvx: compacted %d-token context with kvzip (p=%g): kept %s entries per attention layer",
                    context.n, keep_fraction, keep.kept_per_layer)

