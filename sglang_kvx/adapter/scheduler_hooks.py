"""The hooks in scheduler processes: each hands SGLang's objects, as views, to the runtime.

SGLang has no extension point for "this request's prefix comes from elsewhere", so compaction
wraps the narrow functions that decide a request's prefix, positions and release. The runtime
rides on the scheduler's request-to-token pool and on every forward batch built from it
(``forward.py``); a hook finding none (``--kvx-policy none``) passes straight through.
"""

from __future__ import annotations

import logging
import os

import torch

from sglang_kvx.adapter.attention_inputs import tap_attention_inputs
from sglang_kvx.adapter.contract import PAGE_TABLE_READERS, SCHEDULER_HOOKS, check_applied
from sglang_kvx.adapter.forward import Link, attach, link_of, runtime_of
from sglang_kvx.adapter.graph_replay import silent_in_replay
from sglang_kvx.adapter.cell_space import around_create_kv_buffers  # noqa: F401 (a hook, found by name)
from sglang_kvx.adapter.views import SGLangKVPool, SGLangRequest, SGLangTensorParallel, decode_sub_batch
from sglang_kvx.decode.row_state import FINAL_HIDDEN, INPUT_EMBEDDINGS, ForwardOutputs
from sglang_kvx.ops.host_syncs import device_positions
from sglang_kvx.serve.request_state import usage_of, waits, waits_for_room

logger = logging.getLogger(__name__)


def register_scheduler_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    functions = globals()
    for target, (name, kind) in SCHEDULER_HOOKS.items():
        # A graph replay runs none of them (a real one cannot; the CPU emulation makes them pass through).
        HookRegistry.register(target, silent_in_replay(functions[name], kind), HookType(kind))


# --- the runtime's life ----------------------------------------------------------------


def after_scheduler_init(_result, scheduler, *_args, **_kwargs) -> None:
    from sglang_kvx.adapter.server_config import config_of, on_cpu_platform

    config = config_of(scheduler.server_args)
    if not config.enabled:
        return
    check_applied()  # compaction without every hook would be wrong: refuse to start
    runtime = build_runtime(scheduler, config)
    # SGLANG_KVX_GDN_SIGNALS=recompute takes the GPU route on CPU too (tests keep it honest).
    runtime.gdn_from_backend = on_cpu_platform() and os.environ.get("SGLANG_KVX_GDN_SIGNALS") != "recompute"
    collector = getattr(scheduler, "metrics_collector", None)  # SGLang's, with --enable-metrics (stats rank)
    link = Link(runtime, metrics=None if collector is None else _metrics(collector.labels))
    if os.environ.get(COUNT_HOST_SYNCS) in ("1", "where"):
        link.host_syncs = {}
    runner = scheduler.tp_worker.model_runner
    for holder in link_holders(scheduler.req_to_token_pool, runner.model, runner.attn_backend):
        attach(holder, link)
    tap_attention_inputs(runner.model)  # attention layers' input hidden states, for what reads them
    warm_up_kernels(config, runtime)


def warm_up_kernels(config, runtime) -> None:
    """Compile and check, on tiny shapes, each kernel this server's configuration will run (``ops/warmup.py``),
    here at start rather than inside the first request that needs it; one that fails falls back to its reference."""
    from sglang_kvx.ops.warmup import warm_up

    ops = ["prefix_attention"]  # children of contexts with per-layer lengths
    if config.decode_steps:
        ops += ["window_attention"] + (["state_snapshot"] if runtime.pool.has_state else [])
    if "gdn" in runtime.defaults.model_signals:
        ops.append("gatesight_utility")
    if runtime.decode.facts.gates is not None:  # the learned-gate family's attention backend
        ops.append("gated_attention")
    if config.sparse_budget:
        ops += ["block_compress", "block_select", "block_sparse_attention"]
    warm_up(ops, runtime.pool.device)


def _metrics(labels):
    from sglang_kvx.adapter.metrics import KvxMetrics

    return KvxMetrics(labels)


def link_holders(req_to_token_pool, model, attn_backend) -> list:
    """Every object a hook is handed that can carry the link: the pool, the attention and
    linear-attention layers (with their decoder layers' ``attn``), and the attention backends."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    holders = [req_to_token_pool]
    holders += [m for m in model.modules() if isinstance(m, (RadixAttention, RadixLinearAttention))]
    pending = [attn_backend]
    while pending:
        backend = pending.pop()
        if backend is None or any(backend is h for h in holders):
            continue
        holders.append(backend)
        pending += [getattr(backend, name, None)
                    for name in ("full_attn_backend", "linear_attn_backend", "prefill_backend", "decode_backend")]
    return holders


def context_file_fingerprint(scheduler, pool, attention_ids: list[int], gdn_ids: list[int]) -> str:
    """What a context file on disk must match to be restored here: this model, tokenizer and KV layout."""
    from sglang_kvx.store.disk import model_fingerprint

    runner = scheduler.tp_worker.model_runner
    return model_fingerprint(runner.model_config.model_path, getattr(scheduler.server_args, "tokenizer_path", None) or "", {
        "kv_dtype": str(runner.kv_cache_dtype), "kv_heads": pool.num_kv_heads, "head_dim": pool.head_dim,
        "attention_layer_ids": list(attention_ids), "gdn_layer_ids": list(gdn_ids), "tp_size": int(scheduler.tp_size),
        "revision": getattr(scheduler.server_args, "revision", None) or ""})


def build_runtime(scheduler, config):
    from sglang_kvx.adapter.attention import has_per_layer_lengths
    from sglang_kvx.adapter.model import attention_and_gdn_layer_ids, rope_inv_freq
    from sglang_kvx.config import traits_of_config
    from sglang_kvx.serve.runtime import Runtime
    from sglang_kvx.settings import ServerDefaults

    runner = scheduler.tp_worker.model_runner
    hf = runner.model_config.hf_text_config
    attention_ids, gdn_ids = attention_and_gdn_layer_ids(runner.model_config.hf_config)
    pool = SGLangKVPool(scheduler, attention_ids)
    # Every flag's typed value as the launcher validated it, and what only this process knows.
    defaults = ServerDefaults.of(
        config, model_signals=traits_of_config(runner.model_config.hf_config.to_dict()).signals,
        tp_size=int(scheduler.tp_size), per_layer_lengths=has_per_layer_lengths(runner.attn_backend),
        growth_estimate_cap=growth_estimate_cap(), page_size=int(scheduler.page_size),
        model_fingerprint=context_file_fingerprint(scheduler, pool, attention_ids, gdn_ids) if config.context_dir else "",
    )

    def submit(rid: str, input_ids: list[int], compact: bool = False, namespace: tuple | None = None) -> None:
        from sglang_kvx.adapter.internal_requests import prefill_only_request

        scheduler.handle_generate_request(prefill_only_request(rid, input_ids, compact, namespace))

    return Runtime(
        config, pool, defaults, num_rows=scheduler.req_to_token_pool.size + 1, num_q_heads=hf.num_attention_heads,
        attention_layer_ids=attention_ids, gdn_layer_ids=gdn_ids, rope_inv_freq=rope_inv_freq(hf, pool.head_dim),
        submit=submit, tokenizer=getattr(scheduler, "tokenizer", None), context_len=scheduler.model_config.context_len,
        gates=getattr(runner.attn_backend, "gates", None),  # the kvx_gated backend's (learned-gate family only)
        tp=SGLangTensorParallel() if int(scheduler.tp_size) > 1 else None,
        num_kv_heads_total=getattr(hf, "num_key_value_heads", None),  # absent (MHA configs): the pool's count
    )


def after_get_output_streamer_class(streamer_class, scheduler, *_args, **_kwargs):
    """SGLang's output streamer subclass hook: responses of a compacting server carry
    meta_info["kvx"] (a parent compacted or not and why, a child's compacted prefix)."""
    from sglang_kvx.adapter.server_config import config_of

    if not config_of(scheduler.server_args).enabled:
        return streamer_class
    return _outcome_streamer(streamer_class)


_STREAMERS: dict[type, type] = {}  # one subclass per SGLang streamer class (a cache of types, not state)


def _outcome_streamer(base: type) -> type:
    if base not in _STREAMERS:
        def build_additional_customized_info(self, reqs) -> dict[str, list]:
            from sglang_kvx.adapter.usage import USAGE_KEY

            runtime = runtime_of(self.tree_cache.req_to_token_pool)
            if runtime is None:
                return {}
            outcomes = [runtime.outcome_once(SGLangRequest(req)) for req in reqs]
            usage = [usage_of(SGLangRequest(req)) for req in reqs]
            # Most outputs carry nothing to report: then no field at all (nothing to pickle and merge).
            info = {"kvx": outcomes} if any(outcomes) else {}
            if any(usage):
                info[USAGE_KEY] = usage  # consumed in the HTTP process (adapter/usage.py), never shown
            return info

        _STREAMERS[base] = type(f"Kvx{base.__name__}", (base,), {
            "__module__": __name__, "__slots__": (), "has_additional_customized_info": True,
            "build_additional_customized_info": build_additional_customized_info,
        })
    return _STREAMERS[base]


def growth_estimate_cap() -> int:
    """SGLang's cap on a request's estimated growth when its scheduler admits it."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    return int(CLIP_MAX_NEW_TOKENS)


def around_flush_cache(original, scheduler, *args, **kwargs):
    result = original(scheduler, *args, **kwargs)
    runtime = runtime_of(scheduler.req_to_token_pool)
    if runtime is not None and scheduler.token_to_kv_pool_allocator.available_size() == scheduler.max_total_num_tokens:
        runtime.forget_all()  # SGLang cleared every pool: the store's slots went with them
    _sync_metrics(scheduler.req_to_token_pool)
    return result


def _sync_metrics(holder) -> None:
    link = link_of(holder)
    if link is not None and link.metrics is not None:
        link.metrics.sync(link.runtime)


def after_session_held_tokens(held, observer, *_args, **_kwargs):
    # SGLang's idle leak check balances the pool against what the tree and sessions hold; the
    # store holds slots the way a session does.
    runtime = runtime_of(observer.tree_cache.req_to_token_pool)
    return held + (runtime.held_slots() if runtime is not None else 0)


# --- a request's prefix, rows and release ------------------------------------------------


def around_init_next_round_input(original, req, tree_cache=None, cow_mamba=None):
    from sglang_kvx.serve.runtime import CHILD

    runtime = runtime_of(tree_cache.req_to_token_pool) if tree_cache is not None else None
    plan = runtime.before_round(SGLangRequest(req)) if runtime is not None else None
    if plan is None:
        return original(req, tree_cache, cow_mamba)
    # Refresh the fill ids without touching the tree and take an empty match at the root: a parent
    # then prefills its whole context; a child claims the stored rank slots as its protected prefix;
    # a waiting child holds nothing of the tree (around_add_one_req keeps it queued).
    from array import array

    from sglang.srt.mem_cache.common import match_kv_cache

    original(req, None, cow_mamba)
    match_kv_cache(req, tree_cache, array("q"), cow_mamba=False, max_prefix_len=0)
    if plan != CHILD:
        return
    num_slots = req._kvx_state.context.num_slots
    req.prefix_len = num_slots
    req.num_matched_prefix_tokens = num_slots
    req.kv.cache_protected_len = num_slots  # SGLang frees only what lies past it


def around_add_one_req(original, adder, req, *args, **kwargs):
    """Where SGLang charges a request to the round's budget: a child whose context is held below the
    pool gets it back only if the budget (live: after every request admitted before it) has room, then
    is matched again (now a child, or plain). A child whose restore waits for room ends the round as
    any request that does not fit does (NO_TOKEN); one waiting for its context's second passes or its
    file stays in the queue while the requests behind it go on. A request SGLang's own check turns
    away for want of room (NO_TOKEN: it pins the request's matched prefix, reserves the running
    requests' growth and admits only a total below the budget) is checked again after each idle
    context evicted for it: on plain SGLang what those contexts hold would be evictable cache."""
    runtime = runtime_of(adder.tree_cache.req_to_token_pool)
    if runtime is not None:
        from sglang.srt.managers.schedule_policy import AddReqResult
        from sglang_kvx.adapter.views import SGLangRoundBudget

        request = SGLangRequest(req)
        if runtime.admit_restore(request, SGLangRoundBudget(adder)):
            req.init_next_round_input(adder.tree_cache)
        if waits(request):
            return AddReqResult.NO_TOKEN if waits_for_room(request) else AddReqResult.CONTINUE
        result = original(adder, req, *args, **kwargs)
        while result == AddReqResult.NO_TOKEN and may_ask_again(adder, req) and runtime.make_way(request):
            result = original(adder, req, *args, **kwargs)
        if adder.can_run_list and adder.can_run_list[-1] is req:
            # SGLang's hit-rate counts the child's S slots as its cached prefix; the prompt tokens it did
            # not prefill are the context's n (sglang:cache_hit_rate, the realtime prefill_cache tokens).
            for usage in usage_of(request):
                adder.log_hit_tokens += usage["hidden"]
        else:
            runtime.left_in_queue(request)  # a child SGLang did not take pins no context meanwhile
        return result
    return original(adder, req, *args, **kwargs)


def may_ask_again(adder, req) -> bool:
    """Whether an idle context should go and ``add_one_req`` be called again for a request it turned
    away with NO_TOKEN: only where the round's token budget is what it lacks (NO_TOKEN also means no
    free recurrent-state slot on a hybrid model, which evicting contexts would not give: every idle
    context would go for nothing), and not on the path for ``ignore_eos`` requests without a radix
    cache, which records the request's growth before its checks (a second call would count it
    twice); its other checks change nothing before they pass."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    if adder.can_run_list and adder.can_run_list[-1] is req:
        return False
    if req.sampling_params.ignore_eos and getattr(adder.tree_cache, "disable", True):
        return False
    growth = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    need = len(req.full_untruncated_fill_ids) - req.prefix_len + growth + adder.per_req_token_overhead
    return need >= min(adder.rem_total_tokens, adder.cur_rem_tokens)  # SGLang admits a total below it


def after_release_aborted_request(result, scheduler, req, *_args, **_kwargs):
    """A queued request aborted before it ran (its client went away): a context it adopted is idle again."""
    runtime = runtime_of(scheduler.req_to_token_pool)
    if runtime is not None:
        runtime.left_in_queue(SGLangRequest(req))
    return result


def around_prefix_device_indices(original, tree_cache, req):
    runtime = runtime_of(tree_cache.req_to_token_pool)
    slots = runtime.admission.rows.prefix_slots(SGLangRequest(req)) if runtime is not None else None
    return original(tree_cache, req) if slots is None else slots


def around_alloc_for_extend(original, batch, *args, **kwargs):
    """A prefill batch's slots. SGLang budgeted it when it formed the batch, but a chunked request's
    later chunks are allocated without a budget check (they must make progress), and what compaction
    took in between (a parent whose context was mostly a prefix-cache hit owns too few slots for its
    compacted copy) is not in that budget: idle compacted contexts make way first, as SGLang's prefix
    cache would, so that the allocation cannot fail for want of what they hold (it ended the scheduler
    under SGLang's bench_serving). Then the rows are assigned."""
    runtime = runtime_of(batch.req_to_token_pool)
    if runtime is None:
        return original(batch, *args, **kwargs)
    page = batch.token_to_kv_pool_allocator.page_size
    runtime.make_extend_room(int(batch.extend_num_tokens) + page * len(batch.reqs))  # a page of rounding per request
    result = original(batch, *args, **kwargs)
    runtime.after_alloc([SGLangRequest(req) for req in batch.reqs])
    return result


def around_init_req_max_new_tokens(original, scheduler, req, *args, **kwargs):
    requested = req.sampling_params.max_new_tokens
    result = original(scheduler, req, *args, **kwargs)
    runtime = runtime_of(scheduler.req_to_token_pool)
    if runtime is not None and requested is None and req.to_finish is None:
        # max_new_tokens null: SGLang's clip is the whole pool; the store's reserve holds part of it.
        bound = runtime.growth_bound(SGLangRequest(req), req.sampling_params.max_new_tokens)
        if bound is not None:
            req.sampling_params.max_new_tokens = bound
    elif runtime is not None and req.to_finish is None:
        # SGLang's max_req_len is bounded by the pool too; the model's context length is the limit here.
        bound = runtime.bounded_max_new_tokens(SGLangRequest(req), requested, scheduler.model_config.context_len,
                                               scheduler.max_total_num_tokens)
        if bound is not None and bound > req.sampling_params.max_new_tokens:
            req.sampling_params.max_new_tokens = bound
    return result


def around_check_decode_capacity(original, allocator, *args, **kwargs):
    """A decode step that does not fit: the store gives up idle unreserved contexts before SGLang retracts."""
    if original(allocator, *args, **kwargs):
        return True
    tree_cache = kwargs.get("tree_cache")
    runtime = runtime_of(tree_cache.req_to_token_pool) if tree_cache is not None else None
    if runtime is None or not runtime.make_decode_room(kwargs.get("num_tokens", 0)):
        return False
    return original(allocator, *args, **kwargs)


def around_release_kv_cache(original, req, tree_cache, *args, **kwargs):
    runtime = runtime_of(tree_cache.req_to_token_pool)
    if runtime is not None:
        runtime.before_release(SGLangRequest(req))
    result = original(req, tree_cache, *args, **kwargs)
    _sync_metrics(tree_cache.req_to_token_pool)
    return result


# --- forward time ----------------------------------------------------------------------


def around_is_disable_overlap_for_batch(original, scheduler, batch, last_batch=None, *args, **kwargs):
    """Under the overlap scheduler SGLang launches a batch before it processes the previous one's results. A
    decode batch holding a row's first decode step waits for them instead: that row's prefill results are
    where SGLang caches its prompt (the request's owned start moves), and a step frees only what is the
    request's own. Every later step overlaps as usual."""
    if original(scheduler, batch, last_batch, *args, **kwargs):
        return True
    runtime = runtime_of(scheduler.req_to_token_pool)
    if runtime is None or not runtime.decode or batch is None or not batch.forward_mode.is_decode():
        return False
    return runtime.decode.before_first_step([SGLangRequest(req).row for req in batch.reqs if req.kv.holds_kv])


# A diagnostic (issue #56 item 3): each forward counted for what would make a GPU wait for the host,
# the last of each mode and batch size in /kvx/stats (``host_syncs``; ``=where`` adds each call's line).
# Slows every forward: measuring only.
COUNT_HOST_SYNCS = "SGLANG_KVX_COUNT_HOST_SYNCS"


def around_model_forward(original, model_runner, forward_batch, *args, **kwargs):
    link = link_of(model_runner.req_to_token_pool)
    if link is None or link.host_syncs is None:
        return _model_forward(original, model_runner, forward_batch, *args, **kwargs)
    from sglang_kvx.ops.host_syncs import HostSyncCounter

    decode = link.runtime.decode
    partial_before = decode.partial_reruns if decode else 0
    with HostSyncCounter(where=os.environ.get(COUNT_HOST_SYNCS) == "where") as counter:
        output = _model_forward(original, model_runner, forward_batch, *args, **kwargs)
    mode = "decode" if forward_batch.forward_mode.is_decode() else "extend"
    # "forward": the forward's number among those counted (a reader tells a fresh record from an old one)
    link.host_sync_forwards += 1
    record = {"total": counter.total, **counter.counts, **({"where": dict(counter.where)} if counter.where else {}),
              "forward": link.host_sync_forwards}
    key = f"{mode}[{forward_batch.batch_size}]"
    link.host_syncs[key] = record
    if decode and decode.partial_reruns > partial_before:  # its costliest kind of step: kept apart as well
        link.host_syncs[f"{key} partial re-run"] = record
    return output


def _model_forward(original, model_runner, forward_batch, *args, **kwargs):
    """A forward with decode-step rows. Decode: spans first, the forward, a re-run where a step asks
    (every row's recurrent state restored first, so rows not re-run compute the same again), drops.
    What the rows' steps read of the forward besides the logits (``DecodeStep.forward_outputs``) is
    captured for the batch and handed over: the first run's to score it, the kept run's after the step;
    a prefill chunk's after it."""
    link = link_of(model_runner.req_to_token_pool)
    if link is None or not link.runtime.decode:
        return original(model_runner, forward_batch, *args, **kwargs)
    decode, pool = link.runtime.decode, link.runtime.pool
    mode = forward_batch.forward_mode
    if mode.is_extend() and not mode.is_decode():
        rows = link.batch(forward_batch).rows
        wanted = decode.forward_outputs(rows)
        if not wanted:
            return original(model_runner, forward_batch, *args, **kwargs)
        output, outputs = _forward_with_outputs(original, model_runner, forward_batch, wanted, *args, **kwargs)
        decode.after_run(rows, outputs)
        return output
    if not mode.is_decode():
        return original(model_runner, forward_batch, *args, **kwargs)
    batch = link.batch(forward_batch)
    rows = batch.rows
    may_rerun = decode.begin(rows)
    snapshot = pool.snapshot_rows(rows, forward_batch.req_pool_indices) if may_rerun and pool.has_state else None
    wanted = decode.forward_outputs(rows)
    output, outputs = _forward_with_outputs(original, model_runner, forward_batch, wanted, *args, **kwargs)
    again = decode.reruns(may_rerun, rows, outputs)
    if again:
        output, outputs = _rerun(original, model_runner, forward_batch, rows, again, snapshot, output, outputs,
                                 wanted, *args, **kwargs)
    decode.after_run(rows, outputs)
    decode.end(rows, batch.seq_lens)
    return output


def _rerun(original, model_runner, forward_batch, rows, again, snapshot, output, outputs, wanted, *args, **kwargs):
    """Run the step again for the rows in ``again`` (their spans set anew), from their pre-step
    recurrent states; only those rows when the batch has others (a sub-batch), their results
    written over the first run's."""
    runtime = runtime_of(model_runner.req_to_token_pool)
    pool = runtime.pool
    which = [i for i, row in enumerate(rows) if row in set(again)]
    whole = len(which) == len(rows) or (snapshot is not None and not pool.restores_some_rows)
    runtime.decode.count_rerun(partial=not whole)
    # A partial re-run's rows on the device (no host copy: runs of an arange), for the sub-batch and the restore.
    index = None if whole else device_positions(which, forward_batch.input_ids.device)
    if snapshot is not None:
        pool.restore_rows(rows, snapshot, None if whole else which, index)
    if whole:  # a new view: what the layers read is planned anew (the rows' spans changed)
        link_of(model_runner.req_to_token_pool).begin(forward_batch, rows)
        return _forward_with_outputs(original, model_runner, forward_batch, wanted, *args, **kwargs)
    sub = decode_sub_batch(forward_batch, which, index)
    link_of(model_runner.req_to_token_pool).begin(sub, [rows[i] for i in which])  # its rows, as host ints
    sub_output, sub_outputs = _forward_with_outputs(original, model_runner, sub, wanted, *args, **kwargs)
    index = index.to(output.logits_output.next_token_logits.device)
    output.logits_output.next_token_logits[index] = sub_output.logits_output.next_token_logits
    if outputs is not None and outputs.final_hidden is not None:
        hidden = outputs.final_hidden.clone()
        hidden[index.to(hidden.device)] = sub_outputs.final_hidden
        outputs = ForwardOutputs(final_hidden=hidden, input_embeddings=outputs.input_embeddings)  # same tokens fed
    return output, outputs


def _forward_with_outputs(original, model_runner, forward_batch, wanted, *args, **kwargs):
    """The forward, and what ``wanted`` names of it besides the logits (None when nothing): each row's
    final hidden state (the LM head's input at its last position, asked of SGLang's logits processor and
    handed to the client only if the batch asked for it) and its last token's input embedding."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    if not wanted:
        return original(model_runner, forward_batch, *args, **kwargs), None
    asked = forward_batch.capture_hidden_mode
    plain = asked is None or asked == CaptureHiddenMode.NULL
    if FINAL_HIDDEN in wanted and plain:
        forward_batch.capture_hidden_mode = CaptureHiddenMode.LAST
    output = original(model_runner, forward_batch, *args, **kwargs)
    outputs = ForwardOutputs()
    extend = forward_batch.forward_mode.is_extend()
    last = torch.cumsum(forward_batch.extend_seq_lens.to(torch.long), 0) - 1 if extend else None
    if FINAL_HIDDEN in wanted:
        logits = output.logits_output
        hidden = logits.hidden_states
        if forward_batch.capture_hidden_mode == CaptureHiddenMode.FULL and extend:
            hidden = hidden[last]
        outputs.final_hidden = hidden
        if plain:
            forward_batch.capture_hidden_mode = asked
            logits.hidden_states = None
    if INPUT_EMBEDDINGS in wanted:
        ids = forward_batch.input_ids if last is None else forward_batch.input_ids[last.to(forward_batch.input_ids.device)]
        outputs.input_embeddings = model_runner.model.get_input_embeddings()(ids)
    return output, outputs


def after_forward_batch_init(forward_batch, _cls, batch, model_runner=None, *_args, **kwargs):
    """A forward batch was built from the scheduler's (outside any graph): its view takes the rows as host ints
    from there, so no layer reads them back from the device; recordings learn the tokens it runs; children's
    positions are moved on the device, queued on the stream the forward runs on."""
    model_runner = model_runner if model_runner is not None else kwargs.get("model_runner")
    link = link_of(model_runner.req_to_token_pool)
    if link is None:
        return forward_batch
    runtime = link.runtime
    reqs = getattr(batch, "reqs", None) or []
    view = link.begin(forward_batch, [int(req.kv.req_pool_idx) for req in reqs] if len(reqs) == forward_batch.batch_size else None)
    runtime.recorder.expect(view)
    # Children's tokens continue from the true context length (RoPE), not the compacted one.
    if runtime.admission.rows.any_offsets and forward_batch.positions is not None and forward_batch.req_pool_indices is not None:
        offsets = runtime.admission.rows.position_offset[forward_batch.req_pool_indices.to(torch.long)]
        mode = forward_batch.forward_mode
        if mode.is_decode():
            forward_batch.positions = forward_batch.positions + offsets
        elif mode.is_extend():
            per_token = torch.repeat_interleave(offsets, forward_batch.extend_seq_lens.to(torch.long),
                                                output_size=sum(forward_batch.extend_seq_lens_cpu))  # no device read
            forward_batch.positions = forward_batch.positions + per_token[: forward_batch.positions.shape[0]]
        else:
            raise NotImplementedError(f"sglang_kvx: forward mode {mode} with compacted children")
    return forward_batch


def after_attention(output, layer, q, k, v, forward_batch, *args, **kwargs):
    link = link_of(layer)
    if link is None or not link.runtime.recorder:
        return output
    runtime = link.runtime
    index = runtime.compactor.layer_index.get(layer.layer_id)
    if index is None:
        return output
    batch = link.batch(forward_batch)
    runtime.recorder.attention(index, q, batch, layer.tp_q_head_num, layer.qk_head_dim, layer.scaling)
    gate = layer.__dict__.pop("_kvx_pending_gate", None)  # Qwen3-Next's, left by after_qwen3_next_prepare
    if gate is not None:
        runtime.recorder.output_gate(index, gate, batch, layer.tp_q_head_num)
    return output


def around_linear_attention(original, layer, forward_batch, *args, **kwargs):
    link = link_of(layer)
    runtime = link.runtime if link is not None else None
    if runtime is not None and runtime.recorder and not runtime.gdn_from_backend:
        names = ("mixed_qkv", "a", "b")
        values = dict(zip(names, args))
        values.update({name: kwargs[name] for name in names if name in kwargs})
        runtime.recorder.gdn_inputs(layer, link.batch(forward_batch), values["mixed_qkv"], values["a"], values["b"])
    return original(layer, forward_batch, *args, **kwargs)


def after_prepare_qkv_gate(result, decoder_layer, positions, hidden_states, forward_batch, *args, **kwargs):
    link = link_of(decoder_layer.attn)
    if link is not None and link.runtime.recorder and result[3] is not None:
        index = link.runtime.compactor.layer_index.get(decoder_layer.attn.layer_id)
        if index is not None:
            link.runtime.recorder.output_gate(index, result[3], link.batch(forward_batch), decoder_layer.attn.tp_q_head_num)
    return result


def after_qwen3_next_prepare(result, decoder_layer, *args, **kwargs):
    # (q, k, v, gate), or None when the fused prologue declines and the native one runs instead.
    # Neither sees the forward batch: the gate waits on the layer for its RadixAttention.forward.
    link = link_of(decoder_layer.attn)
    if link is not None and link.runtime.recorder and result is not None and result[3] is not None:
        object.__setattr__(decoder_layer.attn, "_kvx_pending_gate", result[3])
    return result


def after_build_attention_backend(backend, *_args, model_runner=None, **_kwargs):
    """Every full-attention backend SGLang builds gets per-layer lengths (``attention.py``) when
    compaction is on; MLA backends keep their own layout and stay as built (flat budgets only)."""
    from sglang_kvx.adapter.server_config import config_of

    if model_runner is None or not config_of(model_runner.server_args).enabled or model_runner.use_mla_backend:
        return backend
    import importlib

    from sglang_kvx.adapter.attention import with_per_layer_lengths

    for built in (backend, *(getattr(backend, name, None) for name in ("full_attn_backend", "decode_backend"))):
        reader = PAGE_TABLE_READERS.get(f"{type(built).__module__}.{type(built).__qualname__}") if built else None
        if reader is not None:
            importlib.import_module(reader)  # registers its reader class (``attention.register_page_table_reader``)
    return with_per_layer_lengths(backend)


def around_can_run_graph(original, graph_runner, forward_batch, *args, **kwargs):
    """Whether a batch replays a captured graph (decode and prefill graphs, CPU graphs): SGLang's answer, then
    the plugin's, decided in this one place. A replay runs none of the plugin's Python, so a batch whose rows
    need it inside the forward runs eagerly, as their policies and steps declare (``serve/graph_eligibility.py``);
    so does one asking for more hidden states than the graph captured (SGLang's decode replay would raise)."""
    if not original(graph_runner, forward_batch, *args, **kwargs):
        return False
    link = link_of(graph_runner.model_runner.req_to_token_pool)
    if link is None:
        return True
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_kvx.serve.graph_eligibility import eager_reason

    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_kvx.adapter.graph_tables import PageTableGraphs

    captured = getattr(graph_runner, "capture_hidden_mode", CaptureHiddenMode.NULL)
    asked = forward_batch.capture_hidden_mode
    variants = getattr(graph_runner, "attention_graph_variants", None)
    reason = eager_reason(link.runtime, link.batch(forward_batch), hidden_captured=captured != CaptureHiddenMode.NULL,
                          hidden_beyond=asked is not None and captured < asked,
                          tables_in_graph=isinstance(variants, PageTableGraphs) and variants.fits(forward_batch),
                          attention_in_replay=getattr(graph_runner, "prefill_backend_name", None) == Backend.BREAKABLE)
    if reason is None:
        return True
    link.graph_declines[reason] = link.graph_declines.get(reason, 0) + 1
    return False


def around_dp_routing(original, controller, req):
    """Send a compacted context's children to the DP rank that holds it (``serve/affinity.py``)."""
    sampling_params = getattr(req, "sampling_params", None)
    if getattr(req, "routed_dp_rank", None) is None and sampling_params is not None and getattr(req, "input_ids", None):
        affinity = controller.__dict__.get("_kvx_affinity")
        if affinity is None:
            from sglang_kvx.adapter.server_config import config_of
            from sglang_kvx.serve.affinity import ContextAffinity

            affinity = controller.__dict__["_kvx_affinity"] = (
                ContextAffinity() if config_of(controller.server_args).enabled else False
            )
        if affinity is not False:
            rank = affinity.route(list(req.input_ids), marks_context(sampling_params), list(controller._active_workers))
            if rank is not None:
                req.routed_dp_rank = rank
    return original(controller, req)


def marks_context(sampling_params) -> bool:
    """Whether a request is a parent: prefill-only unless ``{"kvx": {"compact": ...}}`` says otherwise
    (a request with bad fields is refused at the door and in the scheduler; here it is no parent)."""
    from sglang_kvx.settings import SettingsError, request_fields_of

    try:
        fields = request_fields_of(getattr(sampling_params, "custom_params", None))
    except SettingsError:
        return False
    if fields.compact is not None:
        return fields.compact
    return getattr(sampling_params, "max_new_tokens", None) == 0
