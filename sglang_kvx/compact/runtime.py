"""Compaction inside one SGLang scheduler: parents are compacted after their prefill, children reuse them.

The flow, per context:
  parent request (a prefill-only request, or one whose custom_params ask for it)
    -> SGLang prefills it as usual
    -> at release: read its keys/values from SGLang's pool (signals), score (policy),
       allocate budgets, select per (layer, KV head), copy the kept entries in rank
       order into S of its own slots, layers folded (compact/layout.py), snapshot
       its GDN states, and let SGLang free every other slot of the full context
       (it is not inserted in the tree)
  child request (its prompt starts with a stored context)
    -> its context tokens are replaced by the S stored rank slots as a protected
       prefix; its own tokens keep their true positions (offset n - S), and its
       GDN state slot starts from the parent's snapshot.

Only plugin.py calls into this module; everything SGLang-specific it touches
(Req fields, pools, allocator) is named in the method that touches it.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import torch

from sglang_kvx.config import (
    SERVABLE_POLICIES,
    KvxConfig,
    KvxConfigError,
    check_tensor_parallel,
    make_policy,
    marks_context,
    model_traits,
    parse_keep_fraction,
    parse_protected_prefix_len,
    request_kvx_params,
)
from sglang_kvx.allocate import allocation_names, allocation_needs
from sglang_kvx.compact.layout import PrefixLayout, fold_layers
from sglang_kvx.select import choose_keep_set
from sglang_kvx.signals import ContextSignals, GDNLayerSignals
from sglang_kvx.compact.second_pass import KVzipSecondPass
from sglang_kvx.ops.compaction import compact_gather
from sglang_kvx.store import CompactedContext, ContextStore

logger = logging.getLogger(__name__)

WINDOW = 64  # observation-window queries kept per attention layer (SnapKV's default)
_CHILD = "_kvx_context"  # attribute on a child Req: its CompactedContext
_PARENT_CHECKED = "_kvx_parent_checked"


class KvxRuntime:
    def __init__(self, scheduler, config: KvxConfig) -> None:
        self.config = config
        self.tp_size = int(scheduler.tp_size)
        self._policies: dict[str, Any] = {}
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.req_to_token_pool = scheduler.req_to_token_pool
        runner = scheduler.tp_worker.model_runner
        self.kv_pool = runner.token_to_kv_pool
        hf = runner.model_config.hf_text_config
        # Hybrid configs name their attention layers; dense ones attend in every layer.
        full_ids = getattr(hf, "full_attention_layer_ids", None)
        self.attention_layer_ids = list(full_ids) if full_ids is not None else list(range(hf.num_hidden_layers))
        self.num_q_heads = hf.num_attention_heads
        self.hf_config = hf
        traits = model_traits(scheduler.server_args.model_path)
        self.model_signals = traits.signals if traits is not None else frozenset()
        self.gdn_layer_ids = list(getattr(hf, "linear_layer_ids", None) or [])
        self._inv_freq: torch.Tensor | None = None
        # True when the GDN backend hands its signals over (ours, on CPU); else capture_gdn recomputes them.
        self.gdn_signals_from_backend = False
        self.mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        self.store = ContextStore()
        self.skipped_no_room = 0
        self.failed: list[str] = []  # why compactions failed (the context then stays uncompacted)
        self.scheduler = scheduler
        self.kvzip = KVzipSecondPass(self)  # KVzip's reconstruction passes and the contexts they hold
        self.evicted = 0
        self.tree_cache = scheduler.tree_cache
        self.row_context: dict[int, CompactedContext] = {}
        # Per-layer budgets (PyramidKV, gate) need attention that masks a layer's unused ranks.
        from sglang_kvx.compact.attention import has_per_layer_lengths

        self.per_layer_lengths = has_per_layer_lengths(runner.attn_backend)
        # Parents whose policy reads attention: their queries are captured during the prefill.
        self.captures: dict[int, _ParentCapture] = {}
        self.layer_index = {layer_id: i for i, layer_id in enumerate(self.attention_layer_ids)}
        # Output gates computed where the forward batch is not at hand (Qwen3-Next), by layer id,
        # until that layer's attention runs.
        self.pending_output_gates: dict[int, torch.Tensor] = {}
        # True-position offset of each request row's tokens (n - S for a child, else 0).
        self.position_offset = torch.zeros(self.req_to_token_pool.size + 1, dtype=torch.int64, device=runner.device)
        key_buffer = self.kv_pool.get_key_buffer(self.attention_layer_ids[0])
        self.num_kv_heads, self.head_dim = key_buffer.shape[1], key_buffer.shape[2]
        # One entry = one position's key and value in one attention layer, all KV heads.
        self.bytes_per_entry = 2 * self.num_kv_heads * self.head_dim * key_buffer.element_size()
        self.bytes_per_token = len(self.attention_layer_ids) * self.bytes_per_entry
        # Layers can lend each other empty cells only when their entries have one shape and dtype.
        def kinds(buffer_of) -> set:
            return {(tuple(buffer_of(i).shape[1:]), buffer_of(i).dtype, buffer_of(i).device) for i in self.attention_layer_ids}

        self.fold_layers = (self.per_layer_lengths and len(kinds(self.kv_pool.get_key_buffer)) == 1
                            and len(kinds(self.kv_pool.get_value_buffer)) == 1)

    # --- which requests take part ------------------------------------------------

    @staticmethod
    def _kvx_params(req) -> dict[str, Any]:
        return request_kvx_params(req.sampling_params)

    def is_parent(self, req) -> bool:
        return marks_context(req.sampling_params)

    def settings(self, req) -> tuple[str, float, int, str]:
        """(policy, keep_fraction, protected_prefix_len, allocation) for a request: its custom_params
        ``{"kvx": {...}}`` override the server's flags (allocation: the policy's own unless named,
        e.g. GateSight's scores under "flat" for the allocation ablation). Raises KvxConfigError on bad values."""
        params = self._kvx_params(req)
        policy = params.get("policy", self.config.policy)
        if policy not in SERVABLE_POLICIES or policy == "none":
            valid = ", ".join(sorted(SERVABLE_POLICIES - {"none"}))
            raise KvxConfigError(f"kvx policy {policy!r} cannot compact here; valid choices: {valid}")
        check_tensor_parallel(policy, params.get("allocation"), self.tp_size)
        allocation = params.get("allocation") or self._policy(policy).allocation
        check_tensor_parallel(policy, allocation, self.tp_size)
        if allocation not in allocation_names():
            raise KvxConfigError(f"kvx allocation {allocation!r} is unknown; valid choices: {', '.join(allocation_names())}")
        missing = sorted(allocation_needs(allocation) - self.model_signals)
        if missing:
            raise KvxConfigError(f"kvx allocation {allocation!r} needs {', '.join(missing)}, which this model does not provide")
        if allocation != "flat" and not self.per_layer_lengths:
            raise KvxConfigError(f"kvx allocation {allocation!r} needs per-layer lengths, which this attention backend (MLA) cannot take; use allocation 'flat'")
        keep_fraction = parse_keep_fraction(params.get("keep_fraction", self.config.keep_fraction))
        protected = parse_protected_prefix_len(params.get("protected_prefix_len", self.config.protected_prefix_len))
        return policy, keep_fraction, protected, allocation

    def _policy(self, name: str):
        if name not in self._policies:
            self._policies[name] = make_policy(name, self.config)
        return self._policies[name]

    # --- requests entering a prefill ------------------------------------------------

    def before_round(self, req) -> bool:
        """Called before SGLang matches a request's prefix. True when the request is a child
        whose prefix the caller must take from the store instead of the radix tree."""
        if getattr(req, _CHILD, None) is not None:
            return not req.kv.holds_kv
        if req.output_ids or req.finished():
            return False
        job = self.kvzip.jobs.get(req.rid)
        if job is not None:  # a KVzip reconstruction pass: a child of the held full context
            context = job.context
            self.make_room(len(req.origin_input_ids) - context.n, keep=context)
            req.skip_radix_cache_insert = True
            req.finished_output = True  # internal: SGLang sends nothing to the tokenizer manager
            setattr(req, _CHILD, context)
            context.active_children += 1
            return True
        wanted = len(req.origin_input_ids) + (req.sampling_params.max_new_tokens or 0)
        if self.is_parent(req):
            self.make_room(wanted)
            self._check_parent(req)
            return False
        context = None
        if len(self.store) and self._kvx_params(req).get("compact") is not False:
            # ("compact": false asks for the full cache, as a parent and as a child.)
            try:
                settings = self.settings(req)
            except KvxConfigError as exc:
                req.set_finish_with_abort(f"sglang_kvx: {exc}")
                return False
            context = self.store.longest_prefix_of(req.origin_input_ids, settings)
        if context is None:
            self.make_room(wanted)
            return False
        # Room for the child's own tokens, never by evicting the context it is about to read.
        self.make_room(wanted - context.n, keep=context)
        # Placeholders for the stored rank slots (never embedded: the whole run is a cached prefix).
        question = list(req.origin_input_ids[context.n :])
        req.origin_input_ids = array("q", list(context.context_ids[: context.num_slots]) + question)
        req.skip_radix_cache_insert = True  # its prefix is the store's, not the tree's
        setattr(req, _CHILD, context)
        context.reuse_count += 1
        context.active_children += 1
        context.last_used = time.monotonic()
        return True

    def make_room(self, tokens: int, keep: CompactedContext | None = None) -> None:
        """Evict idle compacted contexts, least recently used first, while the pool (free slots
        plus what the radix tree can evict) cannot hold a waiting request of ``tokens`` tokens.
        SGLang retries a request that does not fit, so this runs again until it does."""
        tree_cache = self.tree_cache
        while self.allocator.available_size() + tree_cache.evictable_size() < tokens:
            idle = [c for c in self.store.contexts.values() if c.active_children == 0 and c is not keep]
            if not idle:
                return
            victim = min(idle, key=lambda c: c.last_used)
            self.store.remove(victim)
            self.allocator.free(victim.slots)
            self.evicted += 1
            logger.info("sglang_kvx: evicted a compacted %d-token context (%d slots) to make room", victim.n, victim.num_slots)

    def _check_parent(self, req) -> None:
        if getattr(req, _PARENT_CHECKED, False):
            return
        setattr(req, _PARENT_CHECKED, True)
        n = len(req.origin_input_ids)
        try:
            policy, _, protected, _ = self.settings(req)
        except KvxConfigError as exc:
            req.set_finish_with_abort(f"sglang_kvx: {exc}")
            return
        if protected >= n:
            req.set_finish_with_abort(
                f"sglang_kvx: protected prefix of {protected} tokens leaves nothing to compact in the {n}-token context"
            )
            return
        if policy == "kvzip":
            longest = n + self.kvzip.pass_length(n, protected)
            limit = self.scheduler.model_config.context_len
            if longest > limit:
                req.set_finish_with_abort(
                    f"sglang_kvx: kvzip's reconstruction pass of this {n}-token context needs {longest} tokens "
                    f"of context length; the server allows {limit} (raise --context-length)"
                )

    def child_prefix_slots(self, req) -> torch.Tensor | None:
        context = getattr(req, _CHILD, None)
        return None if context is None else context.slots[: req.prefix_len]

    def after_alloc(self, reqs) -> None:
        """Rows are assigned now: record each row's position offset; seed children's GDN state slots."""
        for req in reqs:
            row = req.kv.req_pool_idx
            context = getattr(req, _CHILD, None)
            if context is None:
                self.row_context.pop(row, None)
                self.position_offset[row] = 0
                # An aborted parent (to_finish set on bad settings) is prefilled as one stub token.
                if self.is_parent(req) and req.to_finish is None and not req.finished() and row not in self.captures:
                    name, _, _, allocation = self.settings(req)
                    policy = self._policy(name)
                    wanted = (policy.needs | allocation_needs(allocation)) & CAPTURED_SIGNALS
                    if wanted:
                        self.captures[row] = _ParentCapture(
                            n=len(req.origin_input_ids),
                            num_layers=len(self.attention_layer_ids),
                            window=getattr(policy, "window_size", WINDOW) if "attention" in wanted else 0,
                            column_sums=getattr(policy, "reads_column_sums", False),
                            signals=wanted,
                        )
                continue
            self.position_offset[row] = context.n - context.num_slots
            self.row_context[row] = context
            if req.rid in self.kvzip.jobs and row not in self.captures:
                self.captures[row] = _ParentCapture(
                    n=len(req.origin_input_ids), num_layers=len(self.attention_layer_ids), window=0,
                    column_sums=False, signals=frozenset({"reconstruction"}),
                )
            if context.gdn_snapshot is not None and req.prefix_len == context.num_slots:
                self.mamba_pool.load_cpu_copy(context.gdn_snapshot, self.mamba_slot(req))
                # SGLang zeroes a fresh request's state slot later in the same prepare step
                # (a deferred clear); this slot now holds the parent's state instead.
                req.kv.mamba_needs_clear = False

    def masked_rows(self, layer_id: int, forward_batch) -> dict:
        """Batch index -> PrefixCells for each row reading a compacted prefix that layer ``layer_id``
        reads other than as its S slots (masked ranks, borrowed cells). Reads the batch's rows
        (a device sync on GPU) only while a child of such a context is running."""
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return {}
        layer = self.layer_index[layer_id]
        found = {}
        for i, row in enumerate(forward_batch.req_pool_indices.tolist()):
            context = self.row_context.get(row)
            if context is not None and context.prefix_cells[layer] is not None:
                found[i] = context.prefix_cells[layer]
        return found

    def batch_needs_per_layer_lengths(self, forward_batch) -> bool:
        """Whether some row of the batch reads a compacted prefix that a layer reads other than as its S slots."""
        if not any(context.needs_masked_attention for context in self.row_context.values()):
            return False
        return any(self.row_context[row].needs_masked_attention for row in forward_batch.req_pool_indices.tolist()
                   if row in self.row_context)

    def shift_positions(self, forward_batch) -> None:
        """Children's tokens continue from the true context length (RoPE), not the compacted one."""
        if forward_batch.positions is None or forward_batch.req_pool_indices is None:
            return
        offsets = self.position_offset[forward_batch.req_pool_indices.to(torch.long)]
        if not bool(offsets.any()):
            return
        mode = forward_batch.forward_mode
        if mode.is_decode():
            forward_batch.positions = forward_batch.positions + offsets
        elif mode.is_extend():
            per_token = torch.repeat_interleave(offsets, forward_batch.extend_seq_lens.to(torch.long))
            forward_batch.positions = forward_batch.positions + per_token[: forward_batch.positions.shape[0]]
        else:
            raise NotImplementedError(f"sglang_kvx: forward mode {mode} with compacted children")

    def capture_attention(self, layer, q: torch.Tensor, forward_batch) -> None:
        """After an attention layer ran (its KV is in the pool): record what attention-reading
        policies need from the parents in this batch — the last queries of the context (SnapKV's
        observation window) and, for H2O, every context query's attention summed per key."""
        layer_index = self.layer_index.get(layer.layer_id)
        if layer_index is None or not forward_batch.forward_mode.is_extend():
            return
        rows = forward_batch.req_pool_indices.tolist()
        if not any(row in self.captures for row in rows):
            return
        starts = forward_batch.extend_start_loc.tolist()
        lengths = forward_batch.extend_seq_lens_cpu
        prefixes = forward_batch.extend_prefix_lens_cpu
        key_buffer = self.kv_pool.get_key_buffer(layer.layer_id)
        num_q_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        for i, row in enumerate(rows):
            capture = self.captures.get(row)
            if capture is None or not capture.reads_queries:
                continue
            t0 = time.perf_counter()
            queries = q[starts[i] : starts[i] + lengths[i]].reshape(-1, num_q_heads, head_dim).float()
            if capture.window:
                capture.add_window(layer_index, queries)
            if "reconstruction" in capture.signals:
                capture.add(capture.pass_queries, layer_index, queries)
                capture.scaling[layer_index] = layer.scaling
            if "queries" in capture.signals:
                from sglang_kvx.policies.triattention import query_statistics

                positions = prefixes[i] + torch.arange(queries.shape[0], device=queries.device)
                capture.add(capture.query_stats, layer_index,
                            query_statistics(queries.transpose(0, 1), positions, self.rope_inv_freq()))
            if capture.column_sums:
                seq_len = prefixes[i] + lengths[i]
                keys = key_buffer[self.req_to_token_pool.req_to_token[row, :seq_len].to(torch.long)].float()
                keys = keys.repeat_interleave(num_q_heads // keys.shape[1], dim=1)  # [S, Hq, D]
                sums = capture.column_sums_of(layer_index)
                for start in range(0, queries.shape[0], 512):  # bounded [Hq, 512, S] at a time
                    block = queries[start : start + 512]
                    logits = torch.einsum("thd,shd->hts", block, keys) * layer.scaling
                    query_pos = prefixes[i] + start + torch.arange(block.shape[0])
                    future = torch.arange(seq_len)[None, :] > query_pos[:, None]
                    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
                    sums[:, :seq_len] += probs.sum(dim=1)
            capture.seconds += time.perf_counter() - t0

    def _parent_rows(self, forward_batch):
        """(row index in batch, capture, token start, token count) of the parents in an extend batch."""
        if not forward_batch.forward_mode.is_extend():
            return []
        rows = forward_batch.req_pool_indices.tolist()
        starts = forward_batch.extend_start_loc.tolist()
        lengths = forward_batch.extend_seq_lens_cpu
        return [(i, self.captures[row], starts[i], lengths[i]) for i, row in enumerate(rows) if row in self.captures]

    def capture_gdn(self, layer, forward_batch, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Before a GDN layer runs: its write gate beta, log-decay g and written-value norm ||v||
        (after the causal conv, as the delta rule sees v) for every parent token in the batch."""
        from sglang_kvx.ops.gdn import causal_conv1d, gdn_gates

        if not isinstance(mixed_qkv, torch.Tensor):
            raise NotImplementedError("sglang_kvx: GDN signal capture needs the unfused mixed_qkv projection")
        v_channels = slice(layer.q_dim + layer.k_dim, layer.q_dim + layer.k_dim + layer.v_dim)
        weight = layer.conv_weights[v_channels]
        bias = layer.bias[v_channels] if layer.bias is not None else None
        for _, capture, start, length in self._parent_rows(forward_batch):
            if "gdn" not in capture.signals:
                continue
            t0 = time.perf_counter()
            g, beta = gdn_gates(layer.A_log, a[start : start + length], b[start : start + length], layer.dt_bias)
            # A later prefill chunk continues the conv from the previous chunk's last inputs.
            tail = capture.conv_tail.get(layer.layer_id)
            v, capture.conv_tail[layer.layer_id] = causal_conv1d(
                mixed_qkv[start : start + length, v_channels].float(), weight, bias, tail, layer.activation
            )
            v_norm = v.reshape(length, layer.num_v_heads, layer.head_v_dim).norm(dim=-1)
            capture.add(capture.gdn, layer.layer_id, (beta.float(), g.float(), v_norm.float()))
            capture.seconds += time.perf_counter() - t0

    def capture_gdn_from_backend(self, layer, forward_batch, i: int, beta: torch.Tensor, g: torch.Tensor, v: torch.Tensor) -> None:
        """Our CPU GDN backend hands over what it computed anyway (``TorchGDNAttnBackend.signal_listener``)."""
        if not self.captures or not forward_batch.forward_mode.is_extend():
            return
        capture = self.captures.get(int(forward_batch.req_pool_indices[i]))
        if capture is None or "gdn" not in capture.signals:
            return
        t0 = time.perf_counter()
        v = v.float()
        # sqrt(sum v^2): ~1.5x faster than Tensor.norm on CPU, equal to float32 rounding.
        capture.add(capture.gdn, layer.layer_id, (beta.float(), g.float(), (v * v).sum(dim=-1).sqrt_()))
        capture.seconds += time.perf_counter() - t0

    def capture_pending_output_gate(self, layer_id: int, forward_batch) -> None:
        gate = self.pending_output_gates.pop(layer_id, None)
        if gate is not None:
            self.capture_output_gate(layer_id, gate, forward_batch)

    def capture_output_gate(self, layer_id: int, gate: torch.Tensor, forward_batch) -> None:
        """An attention layer's output gate for the parents' tokens: mean sigmoid per query head."""
        layer_index = self.layer_index.get(layer_id)
        if layer_index is None:
            return
        for _, capture, start, length in self._parent_rows(forward_batch):
            if "output_gate" in capture.signals:
                t0 = time.perf_counter()
                per_head = gate[start : start + length].reshape(length, self.num_q_heads, -1)
                # The gate may be a strided view into the fused projection (Qwen3.5); the sigmoid reads it
                # in place (a contiguous copy first costs ~1.5x at 4K on one core).
                capture.add(capture.gates, layer_index, torch.sigmoid(per_head.float()).mean(dim=-1))
                capture.seconds += time.perf_counter() - t0

    def rope_inv_freq(self) -> torch.Tensor:
        """The model's RoPE frequencies (default RoPE; partial rotary as configured)."""
        if self._inv_freq is None:
            hf = self.hf_config
            params = getattr(hf, "rope_parameters", None) or {}
            rope_type = params.get("rope_type", "default")
            if rope_type != "default":
                raise NotImplementedError(f"sglang_kvx: query statistics for rope_type {rope_type!r}")
            theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
            partial = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
            rotary_dim = int(self.head_dim * partial)
            self._inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        return self._inv_freq

    # --- requests leaving ---------------------------------------------------------------

    def before_release(self, req) -> None:
        context = getattr(req, _CHILD, None)
        if context is not None:
            if req.rid in self.kvzip.jobs:
                self.kvzip.finish_pass(req)
            if req.finished():
                context.active_children -= 1
            if req.kv.holds_kv:
                self.position_offset[req.kv.req_pool_idx] = 0
                self.row_context.pop(int(req.kv.req_pool_idx), None)
            return
        if not (req.finished() and self.is_parent(req) and req.kv.holds_kv):
            return
        if is_aborted(req):
            self.captures.pop(int(req.kv.req_pool_idx), None)
            return
        settings = self.settings(req)  # validated when the request entered (_check_parent)
        if self.store.get(req.origin_input_ids, settings) is not None:
            self.captures.pop(int(req.kv.req_pool_idx), None)
            req.skip_radix_cache_insert = True  # the compacted copy already serves this context
            return
        if settings[0] == "kvzip":
            self.kvzip.start(req, settings)
            return
        try:
            compacted = self.compact(req, settings)
        except Exception as exc:  # one bad context must not stop the scheduler serving everyone else
            self.captures.pop(int(req.kv.req_pool_idx), None)
            self.failed.append(f"{type(exc).__name__}: {exc}")
            logger.exception("sglang_kvx: compaction of a %d-token context failed; it stays uncompacted", len(req.origin_input_ids))
            return
        if compacted is not None:
            req.skip_radix_cache_insert = True  # SGLang frees every other slot of the full context

    def compact(self, req, settings: tuple[str, float, int, str]) -> CompactedContext | None:
        policy, keep_fraction, protected, allocation = settings
        t0 = time.perf_counter()
        context_ids = tuple(int(t) for t in req.origin_input_ids)
        n = len(context_ids)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.long)
        signals = self.read_signals(row, protected)
        capture = self.captures.pop(int(req.kv.req_pool_idx), None)
        if capture is not None:
            capture.fill(signals, self.gdn_layer_ids, self.attention_layer_ids)
        t1 = time.perf_counter()
        keep = choose_keep_set(self._policy(policy), signals, keep_fraction, allocation)
        t2 = time.perf_counter()
        layout = fold_layers(keep.kept_per_layer, fold=self.fold_layers)
        slots = self._rank_slots(req, row, layout.num_slots)
        if slots is None:
            logger.warning("sglang_kvx: no room for %d compacted slots; the %d-token context stays uncompacted",
                           layout.num_slots, n)
            self.skipped_no_room += 1
            return None
        self.gather_kept(signals, slots, keep, layout)
        snapshot = None
        if self.mamba_pool is not None:
            snapshot = self.mamba_pool.get_cpu_copy(self.mamba_slot(req))
        context = CompactedContext(
            context_ids=context_ids,
            policy=policy,
            keep_fraction=keep_fraction,
            protected_prefix_len=protected,
            allocation=allocation,
            slots=slots,
            kept_per_layer=keep.kept_per_layer,
            layout=layout,
            prefix_cells=self.prefix_cells(slots, layout),
            keep_positions=[p.cpu() for p in keep.positions],
            gdn_snapshot=snapshot,
            timings={
                "capture_s": capture.seconds if capture is not None else 0.0,  # inside the prefill's forward
                "signals_s": t1 - t0,  # reading keys/values out of the pool, assembling captures
                "score_select_s": t2 - t1,  # policy scores, layer budgets, per-head top-K
                "compact_s": time.perf_counter() - t2,  # rank-slot copy + GDN snapshot
                "bytes_moved": sum(keep.kept_per_layer) * self.bytes_per_entry,
            },
        )
        self.store.add(context)
        logger.info(
            "sglang_kvx: compacted %d-token context with %s (p=%g): kept %s entries per attention layer",
            n, policy, keep_fraction, keep.kept_per_layer,
        )
        return context

    def read_signals(self, row: torch.Tensor, protected: int) -> ContextSignals:
        """Keys and values of the context in slots ``row``, per attention layer [kv_heads, n, D]."""
        keys, values = [], []
        for layer_id in self.attention_layer_ids:
            keys.append(self.kv_pool.get_key_buffer(layer_id)[row].transpose(0, 1).float())
            values.append(self.kv_pool.get_value_buffer(layer_id)[row].transpose(0, 1).float())
        return ContextSignals(
            n=len(row), num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            keys=keys, values=values, protected_prefix_len=protected,
        )

    def gather_kept(self, signals: ContextSignals, slots: torch.Tensor, keep, layout: PrefixLayout) -> None:
        """Copy each (layer, KV head)'s kept entries, in rank order, into ``slots`` as ``layout``
        places them. The entries come from the context's keys/values already read for scoring
        (``read_signals``: float copies of the pool's values, so casting back is exact), hence
        every kept entry is read before anything is written and ``slots`` may be the context's own."""
        kept = []
        for layer, layer_id in enumerate(self.attention_layer_ids):
            positions = keep.positions[layer]  # [kv_heads, K_l]
            keys = compact_gather(signals.keys[layer], positions).to(self.kv_pool.get_key_buffer(layer_id).dtype)
            values = compact_gather(signals.values[layer], positions).to(self.kv_pool.get_value_buffer(layer_id).dtype)
            kept.append((keys.transpose(0, 1), values.transpose(0, 1)))  # [K_l, kv_heads, D]: pool layout
        for layer, (keys, values) in enumerate(kept):
            cells = layout.layers[layer]
            pieces = [(layer, 0, cells.own)] + [(b.layer, b.start, b.end) for b in cells.borrowed]
            rank = 0
            for holder, start, end in pieces:
                holder_id = self.attention_layer_ids[holder]
                self.kv_pool.get_key_buffer(holder_id)[slots[start:end]] = keys[rank : rank + end - start]
                self.kv_pool.get_value_buffer(holder_id)[slots[start:end]] = values[rank : rank + end - start]
                rank += end - start

    def prefix_cells(self, slots: torch.Tensor, layout: PrefixLayout) -> list:
        """Per attention layer, what its attention reads of the context beyond the plain S slots (None: plain)."""
        from sglang_kvx.compact.attention import PrefixCells

        cells = []
        for layer, layer_cells in enumerate(layout.layers):
            if layout.is_plain(layer):
                cells.append(None)
                continue
            borrowed = tuple((self.attention_layer_ids[b.layer], slots[b.start : b.end]) for b in layer_cells.borrowed)
            cells.append(PrefixCells(layout.num_slots, layer_cells.own, borrowed))
        return cells

    def held_slots(self) -> int:
        """Pool slots held outside SGLang's tree and requests: the store's and KVzip's held contexts."""
        return self.store.slots_held() + self.kvzip.held_slots()

    def _rank_slots(self, req, row: torch.Tensor, num_slots: int) -> torch.Tensor | None:
        """Slots for the compacted context. Prefer the parent's own: the copy gathers the kept
        entries into the first S slots the parent owns (gather_kept reads them all before it
        writes), so compaction needs no pool slots beyond what the prefill held. Fresh slots
        only when the parent owns too few (most of its context was a radix-cache hit)."""
        owned_start = int(req.kv.cache_protected_len)
        if len(row) - owned_start >= num_slots:
            slots = row[owned_start : owned_start + num_slots].clone()
            # SGLang frees the parent's row past its protected length: keep these out of it.
            req.kv.cache_protected_len = owned_start + num_slots
            return slots
        fresh = self.allocator.alloc(num_slots)
        return None if fresh is None else fresh.to(torch.long)

    def mamba_slot(self, req) -> torch.Tensor:
        index = req.kv.mamba_pool_idx.reshape(1).to(torch.long)
        translate = getattr(self.req_to_token_pool, "translate_mamba_indices", None)
        return translate(index) if translate is not None else index

    # --- store lifetime ----------------------------------------------------------------

    def forget_all(self) -> None:
        """After SGLang flushed its pools (every slot is free again), drop the store's references."""
        self.store.contexts.clear()
        self.kvzip.jobs.clear()
        self.captures.clear()
        self.row_context.clear()
        self.position_offset.zero_()

    def stats(self) -> dict[str, Any]:
        return {
            "compacted_contexts": [c.summary() for c in self.store.contexts.values()],
            "store_slots": self.store.slots_held(),
            "compactions_skipped_no_room": self.skipped_no_room,
            "compactions_failed": len(self.failed),
            "last_compaction_error": self.failed[-1] if self.failed else None,
            "contexts_evicted": self.evicted,
            "kvzip_passes_pending": len(self.kvzip.jobs),
            # Served by /kvx/keep_sets only (large): what each context keeps, per layer and KV head.
            "keep_sets": [
                {**c.summary(), "positions": c.keep_positions_lists} for c in self.store.contexts.values()
            ],
        }


def is_aborted(req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


# Signals captured during a parent's prefill (the rest, keys and values, are read from the pool).
CAPTURED_SIGNALS = frozenset({"attention", "gdn", "output_gate", "queries"})  # "reconstruction": second_pass.py


class _ParentCapture:
    """Per parent, what its policy reads from inside the prefill, gathered chunk by chunk:
    the last ``window`` queries and optional column sums per attention layer (SnapKV, H2O),
    query statistics (TriAttention), output gates per attention layer and beta / g / ||v|| per
    GDN layer (GateSight)."""

    def __init__(self, n: int, num_layers: int, window: int, column_sums: bool, signals: frozenset[str]) -> None:
        self.n = n
        self.window = window
        self.column_sums = column_sums
        self.signals = signals
        self.window_queries: list[torch.Tensor | None] = [None] * num_layers  # [w, Hq, D]
        self._sums: list[torch.Tensor | None] = [None] * num_layers
        self.gates: dict[int, list[torch.Tensor]] = {}  # attention layer index -> chunks [t, Hq]
        self.gdn: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # GDN layer id -> chunks of (beta, g, v_norm)
        self.query_stats: dict[int, list[Any]] = {}  # attention layer index -> per-chunk QueryStatistics
        self.conv_tail: dict[int, torch.Tensor] = {}
        self.seconds = 0.0  # spent capturing during the prefill
        self.pass_queries: dict[int, list[torch.Tensor]] = {}  # KVzip pass: attention layer -> chunks [t, Hq, D]
        self.scaling: dict[int, float] = {}

    @property
    def reads_queries(self) -> bool:
        """Whether anything this parent's policy reads comes from the attention layers' queries."""
        return bool(self.window or self.column_sums or {"reconstruction", "queries"} & self.signals)

    @staticmethod
    def add(store: dict, key: int, value) -> None:
        store.setdefault(key, []).append(value)

    def add_window(self, layer: int, queries: torch.Tensor) -> None:
        # Chunked prefill: a later chunk's queries push the earlier ones out of the window.
        previous = self.window_queries[layer]
        joined = queries if previous is None else torch.cat([previous, queries])
        self.window_queries[layer] = joined[-self.window :]

    def column_sums_of(self, layer: int) -> torch.Tensor:
        if self._sums[layer] is None:
            self._sums[layer] = torch.zeros(self.window_queries[layer].shape[1], self.n)
        return self._sums[layer]

    def fill(self, signals: ContextSignals, gdn_layer_ids: list[int], attention_layer_ids: list[int]) -> None:
        """Put everything captured into ``signals`` (a parent seen whole: n tokens per signal)."""
        if self.window:
            signals.window_queries = [w.transpose(0, 1) for w in self.window_queries]
        if self.column_sums:
            signals.attention_column_sums = list(self._sums)
        if "output_gate" in self.signals:
            if len(self.gates) != len(attention_layer_ids):
                raise RuntimeError("sglang_kvx: this model's attention layers reported no output gate")
            signals.output_gate = [torch.cat(self.gates[i]) for i in range(len(attention_layer_ids))]
        if "gdn" in self.signals:
            signals.gdn = [
                GDNLayerSignals(*(torch.cat([chunk[k] for chunk in self.gdn[layer_id]]) for k in range(3)))
                for layer_id in gdn_layer_ids
            ]
            signals.gdn_layer_of_attention = [sum(g < a for g in gdn_layer_ids) for a in attention_layer_ids]
        if "queries" in self.signals:
            from sglang_kvx.policies.triattention import combine_query_statistics

            signals.query_statistics = [combine_query_statistics(self.query_stats[i]) for i in range(len(attention_layer_ids))]
