"""Torch attention for CPU that honours per-layer lengths of compacted prefixes.

A compacted context holds k_max rank slots; attention layer l uses only its first
K_l (PyramidKV and gate-proportional budgets differ per layer). SGLang's
torch-native backend reads every slot of a request's row, so this subclass masks
ranks [K_l, k_max) of a child's prefix in layer l. Rows without such a prefix
take SGLang's own path unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

# (layer_id, req_pool_idx) -> (k_max, K_l) when the row's prefix is compacted with K_l < k_max, else None.
DeadRanks = Callable[[int, int], "tuple[int, int] | None"]


class KvxTorchNativeAttnBackend(TorchNativeAttnBackend):
    dead_ranks: DeadRanks | None = None  # set by the plugin when a runtime exists

    def _masked_rows(self, layer, forward_batch) -> dict[int, tuple[int, int]]:
        if self.dead_ranks is None or layer.is_cross_attention:
            return {}
        rows = forward_batch.req_pool_indices.tolist()
        found = {}
        for i, row in enumerate(rows):
            dead = self.dead_ranks(layer.layer_id, row)
            if dead is not None:
                found[i] = dead
        return found

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        masked = self._masked_rows(layer, forward_batch)
        if not masked:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_masked(q, k, v, layer, forward_batch, save_kv_cache, masked, decode=False)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        masked = self._masked_rows(layer, forward_batch)
        if not masked:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_masked(q, k, v, layer, forward_batch, save_kv_cache, masked, decode=True)

    def _forward_masked(self, q, k, v, layer, forward_batch, save_kv_cache, masked, decode: bool):
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("per-layer compacted lengths with sliding-window attention")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        num_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, num_heads, head_dim)
        out = q.new_empty((q.shape[0], num_heads, layer.v_head_dim))
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens.tolist()
        q_lens = [1] * len(seq_lens) if decode else forward_batch.extend_seq_lens.tolist()
        start = 0
        for i, (row, seq_len, q_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens, q_lens)):
            slots = req_to_token[row, :seq_len].to(torch.long)
            keys = k_cache[slots].transpose(0, 1).float()  # [kv_heads, S, D]
            values = v_cache[slots].transpose(0, 1).float()
            group = num_heads // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            query = q[start : start + q_len].transpose(0, 1).float()  # [H, T, D]
            logits = query @ keys.transpose(1, 2) * layer.scaling  # [H, T, S]
            # Causal over the row: query t sits at row index seq_len - q_len + t.
            visible = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
            if i in masked:
                k_max, kept = masked[i]
                visible[:, kept:k_max] = False  # this layer keeps only its first K_l ranks
            logits = logits.masked_fill(~visible, float("-inf"))
            out[start : start + q_len] = (logits.softmax(-1) @ values).transpose(0, 1).to(out.dtype)
            start += q_len
        return out.reshape(-1, num_heads * layer.v_head_dim)
