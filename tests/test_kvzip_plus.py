"""KVzip+ (issue #57 item 1): the score against explicit loops, its HF producer against the model's own
eager attention weights and output projection, and the policy's ``kvzip_plus`` option."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kvx.policies import get_policy
from sglang_kvx.policies.kvzip import OutputProjections, accumulate_reconstruction_attention, reconstruction_inputs, reconstruction_prompt_ids
from sglang_kvx.reference.kvzip import reconstruction_attention
from sglang_kvx.select import choose_keep_set


@pytest.fixture(scope="module")
def contexts(references):
    return {name: ref.encode("red blue green river mountain forest " * 6) for name, ref in references.items()}


def test_plus_score_weights_each_attention_by_value_over_query_norm():
    """Against explicit loops: a_ji * ||W_O^h v_i|| / ||h_j||, over the repeated chunk's queries only
    (the prompt's first queries do not count), max over queries and each KV group's heads."""
    gen = torch.Generator().manual_seed(7)
    num_q_heads, num_kv_heads, head_dim, n, q_len = 4, 2, 8, 14, 7
    prefix, start, end = 2, 6, 10  # the chunk has 4 tokens: the pass's last 4 queries repeat it
    queries = torch.randn(num_q_heads, q_len, head_dim, generator=gen)
    keys = torch.randn(num_kv_heads, n + q_len, head_dim, generator=gen)
    value_norms = torch.rand(num_q_heads, n, generator=gen) * 3
    hidden_norms = torch.rand(q_len, generator=gen) + 0.5
    total = accumulate_reconstruction_attention(torch.zeros(num_kv_heads, n), queries, keys, start, end,
                                                protected_prefix_len=prefix, plus=(value_norms, hidden_norms))
    expected = torch.zeros(num_kv_heads, n)
    for h in range(num_q_heads):
        kv = h // 2
        for t in range(q_len - (end - start), q_len):
            visible = [*range(prefix), *range(start, end), *range(n, n + t + 1)]
            logits = {j: float(queries[h, t] @ keys[kv, j]) / math.sqrt(head_dim) for j in visible}
            norm = sum(math.exp(v) for v in logits.values())
            for j in [*range(prefix), *range(start, end)]:
                weighted = math.exp(logits[j]) / norm * float(value_norms[h, j]) / float(hidden_norms[t])
                expected[kv, j] = max(expected[kv, j], weighted)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)
    plain = accumulate_reconstruction_attention(torch.zeros(num_kv_heads, n), queries, keys, start, end,
                                                protected_prefix_len=prefix)
    assert not torch.allclose(plain, total)  # the normalisation changes the score (the test can fail)


def test_gram_route_equals_the_direct_projection(tmp_path):
    """OutputProjections (sqrt(v^T W_h^T W_h v), read from a safetensors file) equals ||W_h v||."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    num_q_heads, num_kv_heads, head_dim, hidden = 4, 2, 8, 24
    weights = {f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(hidden, num_q_heads * head_dim, generator=gen)
               for i in (0, 3)}
    weights["model.layers.0.mlp.down_proj.weight"] = torch.randn(4, 4, generator=gen)
    save_file(weights, str(tmp_path / "model.safetensors"))
    values = torch.randn(num_kv_heads, 9, head_dim, generator=gen)
    got = OutputProjections(tmp_path).value_norms(1, values, num_q_heads)  # attention layer 1 = model layer 3
    w = weights["model.layers.3.self_attn.o_proj.weight"]
    for h in range(num_q_heads):
        direct = (values[h // 2] @ w[:, h * head_dim : (h + 1) * head_dim].T).norm(dim=-1)
        torch.testing.assert_close(got[h], direct, atol=1e-4, rtol=1e-4)
    # A tensor-parallel rank holding KV head 1 (query heads 2 and 3) gets those heads' norms.
    rank = OutputProjections(tmp_path).value_norms(1, values[1:], 2, first_q_head=2)
    torch.testing.assert_close(rank, got[2:], atol=1e-5, rtol=1e-5)
    with pytest.raises(FileNotFoundError, match="o_proj"):
        OutputProjections(tmp_path / "nowhere").value_norms(0, values, num_q_heads)


def kvzip_plus_brute_force(ref, context_ids, prompt, chunk_size):
    """Each pass as one plain forward of [context ; pass] with eager attention weights (renormalised over
    the columns KVzip's softmax sees), each weight times ||o_proj(v_i in head h's slice)|| -- the module
    applied to a vector that is v_i in head h's slice and zero elsewhere -- over the norm of
    input_layernorm(the layer's input), from the model's own hidden states."""
    n = len(context_ids)
    config = ref.model.config
    num_q, num_kv = config.num_attention_heads, config.num_key_value_heads
    totals = [torch.zeros(num_kv, n) for _ in ref.attention_layer_ids]
    ref.model.set_attn_implementation("eager")
    try:
        for start, end, ids in reconstruction_inputs(context_ids, *prompt, chunk_size=chunk_size):
            with torch.no_grad():
                out = ref.model(torch.tensor([context_ids + ids]), output_attentions=True, output_hidden_states=True,
                                use_cache=True)
            weights = [w for w in out.attentions if w is not None]
            columns = [*range(start, end), *range(n, n + len(ids))]
            first = len(ids) - (end - start)
            for total, w, layer_id in zip(totals, weights, ref.attention_layer_ids):
                layer = ref.model.model.layers[layer_id]
                values = out.past_key_values.layers[layer_id].values[0, :, :n]  # [Hkv, n, D]
                head_dim = values.shape[-1]
                with torch.no_grad():
                    h = layer.input_layernorm(out.hidden_states[layer_id][0, n + first :]).float().norm(dim=-1)
                    norms = torch.zeros(num_q, n)
                    for head in range(num_q):
                        x = torch.zeros(n, num_q * head_dim)
                        x[:, head * head_dim : (head + 1) * head_dim] = values[head // (num_q // num_kv)]
                        norms[head] = layer.self_attn.o_proj(x).float().norm(dim=-1)
                probs = w[0, :, n + first :, columns].float()
                probs = probs / probs.sum(dim=-1, keepdim=True)
                chunk = probs[..., : end - start] * norms[:, None, start:end] / h[None, :, None]
                best = chunk.amax(dim=1).view(num_kv, -1, end - start).amax(dim=1)
                total[:, start:end] = torch.maximum(total[:, start:end], best)
    finally:
        ref.model.set_attn_implementation("sdpa")
    return totals


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
@pytest.mark.parametrize("chunk_size", [2000, 17])
def test_hf_kvzip_plus_matches_the_models_attention_and_projection(references, contexts, name, chunk_size):
    ref, ids = references[name], contexts[name]
    prompt = reconstruction_prompt_ids(ref.tokenizer)
    scores = reconstruction_attention(ref, ids, chunk_size=chunk_size, plus=True)
    expected = kvzip_plus_brute_force(ref, ids, prompt, chunk_size)
    plain = reconstruction_attention(ref, ids, chunk_size=chunk_size)
    for got, want, raw in zip(scores, expected, plain):
        assert got.shape == (ref.model.config.num_key_value_heads, len(ids)) and (got > 0).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(got, raw)


def test_kvzip_plus_is_an_option_of_kvzip(references, contexts, demo_paths):
    """Same sinks and global threshold as kvzip, on the plus score; the default stays KVzip's."""
    ref, ids = references["tiny-llama"], contexts["tiny-llama"]
    plain, plus = get_policy("kvzip"), get_policy("kvzip_plus")
    assert not plain.plus and plus.plus and issubclass(plus, plain)
    assert plain.second_pass.capture().get("hidden_states") == 0
    assert plus.second_pass.capture().get("hidden_states") == 1  # norms only
    assert not plus.tp_unsafe and not plain.tp_unsafe  # a rank weights its own query heads (below)
    served = plus(model_path=demo_paths["tiny-llama"])
    assert isinstance(served.second_pass.plus, OutputProjections)
    from sglang_kvx.reference.signals import context_signals

    signals = context_signals(ref, ids)
    signals.reconstruction_attention = reconstruction_attention(ref, ids, plus=True)
    keep = choose_keep_set(plus(), signals, 0.3)
    assert keep.per_head  # one threshold over every layer and head, as kvzip
    for layer in range(signals.num_layers):
        assert (plus().score(signals, layer)[:, :4] == float("inf")).all()
        assert keep.mask(layer)[:, :4].all()
