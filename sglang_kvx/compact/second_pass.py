"""Second passes inside SGLang: the further forwards a policy with a ``second_pass`` scores a context
by (``policies.base.SecondPass``; KVzip's context reconstruction is the one shipped).

Such a parent is compacted in two steps instead of one:
  1. at the parent's release its full KV stays in its own slots (held here, counted by SGLang's
     leak check like the store's) with its GDN states snapshotted, and one internal request per
     pass is queued through the scheduler (the adapter's ``submit``: SGLang's own ``handle_generate_request``):
     prompt ids = context + the pass's own (KVzip: its repeat prompt + a chunk). Each pass is a child of the full context
     (the store's child machinery: prefix slots, GDN snapshot restored), so only the pass tokens
     are prefilled, and it never reaches the client (``finished_output``);
  2. as each pass leaves, its captured queries and the keys of [context ; pass] fold into the
     policy's totals (``SecondPass.accumulate``); after the last pass the ``Compactor`` selects and
     compacts within the held slots (the totals as ``ContextSignals.<signal>``) and the rest are freed.
Requests for the context that arrive before the passes finish are served from the full cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sglang_kvx.compact.compactor import Compactor
from sglang_kvx.compact.layout import fold_layers
from sglang_kvx.policies.base import PassLayer, SecondPass
from sglang_kvx.ports import KVPool, Request
from sglang_kvx.settings import CompactionSettings, SettingsError
from sglang_kvx.signals import CaptureSpec
from sglang_kvx.signals.recorder import SignalRecorder
from sglang_kvx.store import CompactedContext, ContextStore

logger = logging.getLogger(__name__)

# Internal request ids: clients cannot send an id with this prefix (refused at the door).
INTERNAL_RID_PREFIX = "kvx-internal-"
PASS_RID_PREFIX = INTERNAL_RID_PREFIX + "pass-"
PASS_SIGNAL = "pass_queries"  # signals/pass_queries.py: what each pass records
PASS_CAPTURE = CaptureSpec(**{PASS_SIGNAL: True})


@dataclass
class PassJob:
    rule: SecondPass  # the policy's second pass
    context: CompactedContext  # the full context (S = n, every layer keeps every position)
    passes: dict[str, tuple[int, int]]  # rid -> (start, end) of its chunk
    totals: list[torch.Tensor]  # per attention layer [kv_heads, n]: what the passes folded in
    started: float = field(default_factory=time.perf_counter)
    accumulate_s: float = 0.0
    failed: str | None = None


def full_context(context_ids: tuple[int, ...], settings: CompactionSettings, slots: torch.Tensor,
                 num_layers: int, gdn_snapshot: Any) -> CompactedContext:
    n = len(context_ids)
    return CompactedContext(
        context_ids=context_ids, settings=settings, slots=slots, kept_per_layer=[n] * num_layers,
        layout=fold_layers([n] * num_layers), prefix_cells=[None] * num_layers, gdn_snapshot=gdn_snapshot,
    )


class SecondPassRunner:
    """The second-pass jobs of one scheduler: start at such a parent's release, fold each pass in
    as it leaves, compact after the last one."""

    def __init__(self, pool: KVPool, compactor: Compactor, store: ContextStore, recorder: SignalRecorder,
                 submit: Callable[[str, list[int]], None], tokenizer: Any, context_len: int,
                 on_failure: Callable[[str], None]) -> None:
        self.pool = pool
        self.compactor = compactor
        self.store = store
        self.recorder = recorder
        self.submit = submit  # queue an internal prefill-only request through the scheduler
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.on_failure = on_failure
        self.jobs: dict[str, PassJob] = {}  # pass request id -> its job
        self.kv_heads: tuple[int, int] | None = None  # under tensor parallelism: the model's KV heads this rank holds
        self._prompts: dict[str, Any] = {}  # policy name -> its passes' prompt ids
        self._job_ids = itertools.count()

    def rule(self, policy: str) -> SecondPass:
        """The served policy instance's second pass (it may hold model resources: KVzip+'s o_proj)."""
        return self.compactor.policy_of(policy).second_pass

    def prompt(self, policy: str) -> Any:
        if policy not in self._prompts:
            if self.tokenizer is None:
                raise SettingsError(f"policy {policy!r} needs the server's tokenizer (do not pass --skip-tokenizer-init)")
            self._prompts[policy] = self.rule(policy).prompt_ids(self.tokenizer)
        return self._prompts[policy]

    def capture_of(self, rid: str) -> CaptureSpec:
        """What pass ``rid`` records inside its forward (its rule's ``capture()``)."""
        job = self.jobs.get(rid)
        return job.rule.capture() if job is not None else PASS_CAPTURE

    def check_fits(self, settings: CompactionSettings, n: int) -> str | None:
        """Why a parent of ``n`` tokens cannot be served (its passes exceed the context length), or None."""
        rule = self.rule(settings.policy)
        longest = n + rule.longest_pass(n, self.prompt(settings.policy), settings.protected_prefix_len)
        if longest > self.context_len:
            return (f"{settings.policy}'s reconstruction pass of this {n}-token context needs {longest} tokens of context "
                    f"length; the server allows {self.context_len} (raise --context-length)")
        return None

    def held_slots(self) -> int:
        jobs = {id(job): job for job in self.jobs.values()}
        return sum(job.context.num_slots for job in jobs.values())

    def pending_for(self, prompt_ids, settings: CompactionSettings | None) -> bool:
        """Whether a held context with ``settings`` (None: any) that the prompt strictly extends is still
        being scored by its passes (a child of it then waits for its compaction)."""
        if not self.jobs:
            return False
        contexts = {id(job.context): job.context for job in self.jobs.values()}.values()
        return any((settings is None or c.settings == settings) and c.n < len(prompt_ids) and tuple(prompt_ids[: c.n]) == c.context_ids
                   for c in contexts)

    def context_of_pass(self, rid: str) -> CompactedContext | None:
        job = self.jobs.get(rid)
        return job.context if job is not None else None

    def start(self, request: Request, settings: CompactionSettings, tenant: str | None = None) -> bool:
        """Hold the parent's full context and queue its reconstruction passes (False: no room)."""
        context_ids = tuple(int(t) for t in request.input_ids)
        n = len(context_ids)
        row = self.pool.row(request.row, n)
        if request.owned_from == 0:
            slots = row.clone()
            request.owned_from = n  # SGLang frees none of them: they are the job's now
        else:  # part of the context was a prefix-cache hit (the tree's slots): take a copy
            slots = self.pool.alloc(n)
            if slots is None:
                logger.warning("sglang_kvx: no room to hold a %d-token context for %s's passes; it stays uncompacted",
                               n, settings.policy)
                return False
            for layer in range(self.pool.num_layers):
                self.pool.write(layer, slots, *self.pool.read(layer, row))
        request.keep_out_of_tree()
        snapshot = self.pool.snapshot_state(request) if self.pool.has_state else None
        context = full_context(context_ids, settings, slots, self.pool.num_layers, snapshot)
        context.tenant = tenant
        rule = self.rule(settings.policy)
        job = PassJob(rule=rule, context=context, passes={},
                      totals=[torch.zeros(self.pool.num_kv_heads, n, device=self.pool.device)
                              for _ in range(self.pool.num_layers)])
        job_id = next(self._job_ids)
        passes = rule.passes(list(context_ids), self.prompt(settings.policy), settings.protected_prefix_len)
        queued = []
        for i, (start, end, ids) in enumerate(passes):
            rid = f"{PASS_RID_PREFIX}{job_id}-{i}"
            job.passes[rid] = (start, end)
            self.jobs[rid] = job
            queued.append((rid, list(context_ids) + ids))
        for rid, ids in queued:
            self.submit(rid, ids)
        logger.info("sglang_kvx: %s holds a %d-token context for %d pass(es)", settings.policy, n, len(passes))
        return True

    def finish_pass(self, request: Request) -> None:
        """A reconstruction pass leaves: fold its attention into the job's scores (its KV is still in the pool)."""
        job = self.jobs.pop(request.rid)
        recording = self.recorder.take(request.row) if request.holds_kv else None
        start, end = job.passes.pop(request.rid)
        complete = (not request.aborted and request.finished and request.holds_kv and recording is not None
                    and len(recording.state(PASS_SIGNAL).chunks) == self.pool.num_layers)
        if complete and (why := recording.incomplete()) is not None:  # a forward ran without the plugin's hooks
            job.failed = job.failed or f"reconstruction pass {request.rid}: {why}"
        elif not complete:
            job.failed = job.failed or f"reconstruction pass {request.rid} did not complete"
        else:
            t0 = time.perf_counter()
            row = self.pool.row(request.row, len(request.input_ids))
            for layer in range(self.pool.num_layers):
                pass_layer = PassLayer(
                    layer=layer, queries=recording.state(PASS_SIGNAL).queries(layer),  # [Hq, m, D]
                    keys=self.pool.read_keys(layer, row).transpose(0, 1).float(),  # [Hkv, n + m, D]
                    scaling=recording.state(PASS_SIGNAL).scaling[layer],
                    values=lambda layer=layer: self.pool.read(layer, row)[1].transpose(0, 1).float(),
                    recording=recording, kv_heads=self.kv_heads)
                job.rule.accumulate(job.totals[layer], pass_layer, start, end,
                                    protected_prefix_len=job.context.settings.protected_prefix_len)
            job.accumulate_s += time.perf_counter() - t0
        if not job.passes:
            self._complete(job)

    def _complete(self, job: PassJob) -> None:
        held = job.context.slots
        if job.failed is not None:
            self.pool.free(held)
            self.on_failure(job.failed)
            logger.error("sglang_kvx: %s compaction failed (%s); the context stays uncompacted",
                         job.context.settings.policy, job.failed)
            return

        def fill(signals) -> None:
            signals.put(job.rule.signal, job.totals)

        try:
            context = self.compactor.compact(
                job.context.context_ids, held, job.context.settings, take_slots=lambda count: held[:count].clone(),
                fill_signals=fill, gdn_snapshot=job.context.gdn_snapshot,
                timings={"second_pass_s": time.perf_counter() - job.started,  # queueing + the passes' prefill
                         "accumulate_s": job.accumulate_s},
            )
        except Exception as exc:  # contained: the held context is returned, the scheduler goes on
            self.pool.free(held)
            self.on_failure(f"{type(exc).__name__}: {exc}")
            logger.exception("sglang_kvx: %s compaction failed; the context stays uncompacted", job.context.settings.policy)
            return
        if context.num_slots < len(held):
            self.pool.free(held[context.num_slots :])
        context.tenant = job.context.tenant
        self.store.add(context)

    def forget_all(self) -> None:
        self.jobs.clear()
