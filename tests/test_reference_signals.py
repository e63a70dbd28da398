"""The offline signal producer against HF's own outputs (cache, eager attention weights, module math)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_kvx.reference.signals import context_signals


@pytest.fixture(scope="module")
def contexts(references):
    return {name: ref.encode("red blue green river mountain forest " * 25) for name, ref in references.items()}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
def test_keys_and_values_are_the_cached_ones(references, contexts, name):
    ref, ids = references[name], contexts[name]
    signals = context_signals(ref, ids, window=16)
    with torch.no_grad():
        cache = ref.model(torch.tensor([ids]), use_cache=True).past_key_values
    for layer, layer_id in enumerate(ref.attention_layer_ids):
        torch.testing.assert_close(signals.keys[layer], cache.layers[layer_id].keys[0].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(signals.values[layer], cache.layers[layer_id].values[0].float(), atol=1e-5, rtol=1e-5)
    assert signals.window_queries[0].shape == (ref.model.config.num_attention_heads, 16, signals.head_dim)


def test_column_sums_equal_eager_attention_weights(references, contexts):
    ref, ids = references["tiny-llama"], contexts["tiny-llama"]
    signals = context_signals(ref, ids)
    ref.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = ref.model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        ref.model.set_attn_implementation("sdpa")
    for layer, weights in enumerate(attentions):
        torch.testing.assert_close(signals.attention_column_sums[layer], weights[0].sum(dim=1).float(), atol=1e-4, rtol=1e-4)


def test_gdn_and_gate_signals_follow_the_module_math(references, contexts):
    ref, ids = references["tiny-hybrid-deep"], contexts["tiny-hybrid-deep"]
    signals = context_signals(ref, ids)
    layers = ref.model.model.layers
    captured = {}

    def keep(key):
        def hook(_module, _inputs, output):
            captured[key] = output[0].detach().clone()  # returns None: the output is left alone

        return hook

    hooks = [layers[0].linear_attn.in_proj_a.register_forward_hook(keep("a")),
             layers[0].linear_attn.in_proj_b.register_forward_hook(keep("b")),
             layers[3].self_attn.q_proj.register_forward_hook(keep("q"))]
    try:
        with torch.no_grad():
            ref.model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    gdn = layers[0].linear_attn
    expected_g = -gdn.A_log.float().exp() * F.softplus(captured["a"].float() + gdn.dt_bias)
    torch.testing.assert_close(signals.gdn[0].g, expected_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(signals.gdn[0].beta, torch.sigmoid(captured["b"].float()), atol=1e-6, rtol=1e-6)
    assert len(signals.gdn) == 6 and signals.gdn_layer_of_attention == [3, 6]  # 2 x [3 GDN + attention]
    assert (signals.gdn[0].v_norm > 0).all()
    head_dim = signals.head_dim
    gate = captured["q"].view(len(ids), -1, 2 * head_dim)[..., head_dim:]
    torch.testing.assert_close(signals.output_gate[0], torch.sigmoid(gate).mean(-1), atol=1e-6, rtol=1e-6)
