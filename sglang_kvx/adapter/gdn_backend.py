"""A pure-torch Gated-DeltaNet linear-attention backend for SGLang on CPU.

SGLang's GDN layers reach either sgl-kernel CPU ops (not on PyPI) or fla
Triton kernels (GPU only). This backend serves the same calls with the torch
ops in ``sglang_kvx.ops.gdn``: the chunked gated delta rule for prefill, the
recurrent step for decode, and the causal-conv state kept in SGLang's own
``MambaPool`` slots, so radix-cache hits restore GDN states as usual.

Pool layouts (SGLang's): conv state [slot, C, K-1]; recurrent state
[slot, Hv, Dv, Dk] (value-major), transposed here to the ops' [Hv, Dk, Dv].
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

from sglang_kvx.adapter.forward import link_of
from sglang_kvx.ops.gdn import causal_conv1d, causal_conv1d_step, gated_delta_rule_chunked, gated_delta_rule_step, gdn_gates


class TorchGDNAttnBackend(MambaAttnBackendBase):
    """GDN for ``extend`` (prefill, with or without a cached prefix) and ``decode``."""

    supports_mis = False
    needs_cpu_seq_lens = False

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        self.conv_states_shape = model_runner.req_to_token_pool.mamba_pool.mamba_cache.conv[0].shape

    def _layer_states(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        return cache.conv[0], cache.temporal

    @staticmethod
    def _split_heads(x: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = torch.split(x, [layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
        n = x.shape[0]
        return (
            q.reshape(n, layer.num_q_heads, layer.head_q_dim),
            k.reshape(n, layer.num_k_heads, layer.head_k_dim),
            v.reshape(n, layer.num_v_heads, layer.head_v_dim),
        )

    def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            raise NotImplementedError("the CPU GDN backend does not serve speculative decoding")
        if not isinstance(mixed_qkv, torch.Tensor):
            raise TypeError("the CPU GDN backend expects an unfused mixed_qkv tensor")
        meta = self.forward_metadata
        conv_states, ssm_states = self._layer_states(layer)
        starts = meta.query_start_loc.tolist()
        slots = meta.mamba_cache_indices.tolist()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        g, beta = gdn_gates(layer.A_log, a, b, layer.dt_bias)
        # A parent's recording takes beta, g and v (after the conv) as computed here: no recomputation.
        link = link_of(self)
        runtime = link.runtime if link is not None else None
        recorder = runtime.recorder if runtime is not None and runtime.gdn_from_backend and runtime.recorder else None
        rows = link.batch(forward_batch).rows if recorder is not None else None
        out = torch.zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        for i in range(len(starts) - 1):
            start, end, slot = starts[i], starts[i + 1], slots[i]
            if end <= start or slot < 0:
                continue
            # A cached prefix (radix hit or chunked prefill) continues from the slot's states.
            continues = prefix_lens is not None and prefix_lens[i] > 0
            x, conv_states[slot] = causal_conv1d(
                mixed_qkv[start:end], layer.conv_weights, layer.bias,
                conv_states[slot] if continues else None, layer.activation,
            )
            q, k, v = self._split_heads(x, layer)
            if recorder is not None:
                recorder.gdn_signals(layer.layer_id, rows[i], beta[start:end], g[start:end], v)
            state0 = ssm_states[slot].transpose(-1, -2) if continues else None
            o, state = gated_delta_rule_chunked(q, k, v, g[start:end], beta[start:end], state0)
            ssm_states[slot] = state.transpose(-1, -2).to(ssm_states.dtype)
            out[start:end] = o.to(out.dtype)
        return out.unsqueeze(0)

    def forward_decode(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        if not isinstance(mixed_qkv, torch.Tensor):
            raise TypeError("the CPU GDN backend expects an unfused mixed_qkv tensor")
        conv_states, ssm_states = self._layer_states(layer)
        slots = self.forward_metadata.mamba_cache_indices.to(torch.long)
        rows = (slots >= 0).nonzero(as_tuple=True)[0]
        bs = forward_batch.batch_size
        out = torch.zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        if rows.numel():
            live = slots[rows]
            x = mixed_qkv[:bs][rows]  # [B, C]
            y, conv_states[live] = causal_conv1d_step(x, conv_states[live], layer.conv_weights, layer.bias, layer.activation)
            q, k, v = self._split_heads(y, layer)
            g, beta = gdn_gates(layer.A_log, a[:bs][rows], b[:bs][rows], layer.dt_bias)
            o, state = gated_delta_rule_step(q, k, v, g, beta, ssm_states[live].transpose(-1, -2))
            ssm_states[live] = state.transpose(-1, -2).to(ssm_states.dtype)
            out[rows] = o.to(out.dtype)
        return out.unsqueeze(0)

