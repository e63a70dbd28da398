"""``kvx_gated``: the attention backend of the learned-gate model family (``models/gated.py``).

The family's attention is not SGLang's softmax: sigmoid cells add b(i) = -log(i + 1), and every
layer past the first scales each key's logit and value by the gate its previous layer wrote with
it (``ops/gated_attention.py``). This backend, registered with SGLang's attention registry, keeps
SGLang's torch-native metadata, writes K/V into SGLang's pool as usual, keeps each slot's gate
beside the pool (one float per slot and layer, ``gates``), and computes attention with the op.

Eviction: a decode row whose step has a gate threshold (``sigmoid-gate``) reads only keys with
g >= tau, plus its own. A row
re-folded by its decode state (``compact/gate_fold.py``, every 64 steps) reads its folded stretch from
the fold's cells, whatever buffer they sit in.

Decode steps that read a span of the row (``streamingllm``, ``span_schedule``, ``oda``): the row
reads its sinks and recent window through the same hidden-interval mechanism as a re-fold (no extra
cells), so the family's own attention (sigmoid bias, gates) applies to them. The backend is marked
``PerLayerLengths`` so the generic per-layer wrapper (plain softmax) never takes its rows.

Per-head eviction (``h2o``, ``keydiff`` decode steps, on the dense cells): the backend hands each
such row's prefill weights to its decode state, reads each decode step's per-head keep mask from
it, and hands back the step's weights (``serve/head_eviction.py``), layer by layer.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_kvx.adapter.attention import PerLayerLengths
from sglang_kvx.adapter.batch_reads import masked_rows_of
from sglang_kvx.adapter.forward import link_of
from sglang_kvx.compact.gate_fold import read_folded
from sglang_kvx.ops.gated_attention import FoldedKeys, gated_attention

from sglang_kvx.config import GATED_ATTENTION_BACKEND as KVX_GATED_ATTENTION


class KvxGatedAttnBackend(TorchNativeAttnBackend, PerLayerLengths):
    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        pool = self.token_to_kv_pool
        num_layers = model_runner.model_config.num_hidden_layers
        num_slots = pool.get_key_buffer(0).shape[0]
        # The gate of each slot's token as written into layer l (rows of layers without a gate stay unused).
        self.gates = torch.ones((num_layers, num_slots), dtype=torch.float32, device=pool.get_key_buffer(0).device)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, key_gate=None, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, key_gate, decode=False, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, key_gate=None, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, key_gate, decode=True, **kwargs)

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, key_gate, decode: bool, **kwargs):
        unsupported = sorted(name for name, value in kwargs.items() if value is not None)
        if unsupported:
            raise NotImplementedError(f"kvx_gated attention with attention options {unsupported}")
        kind = getattr(layer, "kvx_attention_kind", None)
        if kind is None:
            raise NotImplementedError("the kvx_gated attention backend serves only the learned-gate model family (kvx_gated_gpt)")
        pool = self.token_to_kv_pool
        loc = forward_batch.out_cache_loc
        if save_kv_cache:
            pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v, layer.k_scale, layer.v_scale)
        gates = None
        if key_gate is not None:
            self.gates[layer.layer_id, loc] = key_gate.float()
            gates = self.gates[layer.layer_id]
        rows = forward_batch.req_pool_indices
        batch = rows.numel()
        q_lens = torch.ones(batch, dtype=torch.long, device=rows.device) if decode else forward_batch.extend_seq_lens
        num_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        k_cache = pool.get_key_buffer(layer.layer_id)
        # What each row's decode step changes of what it reads here (generic: the runner's rows
        # answer; this backend applies gate thresholds, folds, per-head masks and attention weights).
        seen, runtime = {}, link.runtime if (link := link_of(self)) is not None else None
        if runtime is not None and runtime.decode:
            view = link.batch(forward_batch)
            index = runtime.compactor.layer_index[layer.layer_id]
            req_to_token = self.req_to_token_pool.req_to_token

            def keys_of(i: int, length: int) -> torch.Tensor:
                return k_cache[req_to_token[view.rows[i], :length].long()].transpose(0, 1)

            seen = runtime.decode.visibility(index, view.rows, view.seq_lens, keys_of, decode)
        tau = torch.zeros(batch, dtype=torch.float32)
        if decode and gates is not None and seen:
            tau = torch.tensor([seen[i].gate_threshold if i in seen else 0.0 for i in range(batch)], dtype=torch.float32)
        folded = self._folded(forward_batch, layer, gates is not None, decode, seen)
        masks = {i: visible.head_mask for i, visible in seen.items() if visible.head_mask is not None}
        weights = {i: None for i, visible in seen.items() if visible.wants_attention}
        out = gated_attention(
            q.reshape(-1, num_heads, head_dim), k_cache, pool.get_value_buffer(layer.layer_id),
            gates, self.req_to_token_pool.req_to_token, rows, forward_batch.seq_lens, q_lens,
            forward_batch.positions, tau, kind, layer.scaling, folded=folded, key_keep=masks or None,
            weight_sums=weights or None,
        )
        if seen:
            runtime.decode.after_attention(index, view.rows, view.seq_lens, seen, weights, keys_of, decode)
        return out.reshape(-1, num_heads * layer.v_head_dim)

    def _folded(self, forward_batch, radix_layer, gated: bool, decode: bool, seen: dict) -> FoldedKeys | None:
        """The batch's rows that skip a stretch of their row: re-folded rows (learned-gate eviction),
        which read the fold's kept entries instead, and rows whose decode step reads a span (sinks
        and a window), which read nothing instead."""
        link = link_of(self)
        if link is None or not link.runtime.decode:
            return None
        spans = masked_rows_of(self, radix_layer, forward_batch)
        if spans and (not decode or any(cells.borrowed for cells in spans.values())):
            # Compaction is refused on this family (config, settings): only decode spans reach here.
            raise NotImplementedError("kvx_gated attention over a compacted prefix")
        if not decode:
            return None
        runtime = link.runtime
        batch = link.batch(forward_batch)
        folds = [seen[i].fold if i in seen else None for i in range(len(batch.rows))]
        if not any(folds) and not spans:
            return None
        layer = runtime.compactor.layer_index[radix_layer.layer_id]
        hidden = torch.zeros((2, len(folds)), dtype=torch.long)
        keys, values, gates, counts = [], [], [], [0]
        for i, fold in enumerate(folds):
            read = 0
            if i in spans:  # a span row (its step runs no gate fold): hidden [own, num_slots), no extra cells
                if fold is not None:
                    raise NotImplementedError("a decode row with both a span and a gate fold")
                hidden[0, i], hidden[1, i] = spans[i].own, spans[i].num_slots
            elif fold is not None:
                hidden[0, i], hidden[1, i] = fold.start, fold.end
                k, v, g = read_folded(fold, layer, runtime.pool, self.gates, gated)
                keys.append(k)
                values.append(v)
                gates.append(g)
                read = k.shape[0]
            counts.append(counts[-1] + read)
        if not keys:  # span rows only: no extra cells
            k, v = runtime.pool.read(layer, torch.zeros(0, dtype=torch.long, device=runtime.pool.device))
            keys, values, gates = [k], [v], [self.gates[0, :0]]
        device = forward_batch.req_pool_indices.device
        return FoldedKeys(hidden[0].to(device), hidden[1].to(device), torch.cat(keys), torch.cat(values),
                          torch.cat(gates) if gated else None, torch.tensor(counts, device=device))
