"""TriAttention and KVzip: their math against brute force, their HF producers against the model itself."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kvx.policies import ModelTraits, get_policy
from sglang_kvx.policies.kvzip import accumulate_reconstruction_attention, reconstruction_inputs, reconstruction_prompt_ids
from sglang_kvx.policies.triattention import (
    combine_query_statistics,
    future_offsets,
    predicted_logits,
    query_statistics,
    rotate,
)
from sglang_kvx.reference.kvzip import reconstruction_attention
from sglang_kvx.reference.signals import context_signals, rope_inv_freq
from sglang_kvx.select import choose_keep_set
from sglang_kvx.signals import ContextSignals


def explicit_rope(vector: list[float], position: float, inv_freq: list[float]) -> list[float]:
    """RoPE of one vector, pair by pair with a 2x2 rotation (rotate-half layout, partial rotary)."""
    half = len(inv_freq)
    out = list(vector)
    for f, w in enumerate(inv_freq):
        c, s = math.cos(position * w), math.sin(position * w)
        a, b = vector[f], vector[f + half]
        out[f], out[f + half] = a * c - b * s, b * c + a * s
    return out


def rope_inv_freq_for(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


@pytest.fixture(scope="module")
def contexts(references):
    return {name: ref.encode("red blue green river mountain forest " * 6) for name, ref in references.items()}


# --- TriAttention: RoPE, statistics, prediction -------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
def test_rotate_is_the_models_rope_and_inverts(references, name):
    """Our rotation equals the model's own apply_rotary_pos_emb (partial on the hybrid) and un-rotates exactly."""
    ref = references[name]
    model = ref.model
    module = __import__(type(model.model.layers[0]).__module__, fromlist=["apply_rotary_pos_emb"])
    inv_freq = rope_inv_freq(model)
    head_dim = model.config.head_dim
    assert 2 * inv_freq.shape[0] == (head_dim // 4 if name == "tiny-hybrid-deep" else head_dim)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 50, head_dim, generator=gen)
    k = torch.randn(1, 2, 50, head_dim, generator=gen)
    positions = torch.arange(100, 150)
    cos, sin = model.model.rotary_emb(q, positions[None])
    q_hf, k_hf = module.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotate(q[0], positions, inv_freq), q_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(k[0], positions, inv_freq), k_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(q_hf[0], -positions, inv_freq), q[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary of a 16-dim head
def test_constant_query_predicts_the_mean_future_logit(rotary_dim):
    """One pre-RoPE query per head, seen at many positions: the norm term vanishes and the prediction
    is the mean over future positions n + d of RoPE(q, n + d) . k, computed here pair by pair."""
    gen = torch.Generator().manual_seed(1)
    head_dim, num_q_heads, num_kv_heads, n = 16, 4, 2, 12
    inv_freq = rope_inv_freq_for(rotary_dim, theta=100.0)
    pre_rope = torch.randn(num_q_heads, head_dim, generator=gen)
    positions = torch.arange(30)
    queries = rotate(pre_rope[:, None, :].expand(-1, 30, -1), positions, inv_freq)
    stats = query_statistics(queries, positions, inv_freq)
    torch.testing.assert_close(stats.center, pre_rope, atol=1e-5, rtol=1e-5)
    keys = torch.randn(num_kv_heads, n, head_dim, generator=gen)
    offsets = future_offsets(64)
    assert offsets.tolist() == [1, 2, 4, 8, 16, 32, 64]
    predicted = predicted_logits(stats, keys, offsets)
    group = num_q_heads // num_kv_heads
    for h in range(num_q_heads):
        for i in range(n):
            logits = [
                sum(a * b for a, b in zip(explicit_rope(pre_rope[h].tolist(), n + d, inv_freq.tolist()), keys[h // group, i].tolist()))
                for d in offsets.tolist()
            ]
            assert predicted[h, i].item() == pytest.approx(sum(logits) / len(logits), abs=1e-4)
    # The policy: max over the query heads of each KV group.
    signals = ContextSignals(n=n, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             keys=[keys], values=[keys], query_statistics=[stats])
    scores = get_policy("triattention")(offset_max_length=64).score(signals, 0)
    torch.testing.assert_close(scores, predicted.view(num_kv_heads, group, n).amax(dim=1))


def test_spread_queries_score_by_the_norm_term():
    """Queries +q and -q: the centre is 0, so only the norm term speaks: sum_f E|q_f| |k_f| per frequency pair / unrotated dim."""
    gen = torch.Generator().manual_seed(2)
    head_dim, rotary_dim = 8, 4
    inv_freq = rope_inv_freq_for(rotary_dim)
    q = torch.randn(1, head_dim, generator=gen)
    positions = torch.tensor([3, 7])
    queries = rotate(torch.stack([q, -q], dim=1), positions, inv_freq)  # [1, 2, D]
    stats = query_statistics(queries, positions, inv_freq)
    assert stats.center.abs().max() < 1e-5
    keys = torch.randn(1, 5, head_dim, generator=gen)
    predicted = predicted_logits(stats, keys, future_offsets())
    assert predicted_logits(stats, keys, future_offsets(), use_norm_term=False).abs().max() < 1e-5

    def components(v):  # pairs (0, 2), (1, 3), then dims 4..7 alone
        return [math.hypot(v[0], v[2]), math.hypot(v[1], v[3]), *map(abs, v[4:])]

    for i in range(5):
        expected = sum(a * b for a, b in zip(components(q[0].tolist()), components(keys[0, i].tolist())))
        assert predicted[0, i].item() == pytest.approx(expected, rel=1e-5)


def test_statistics_of_chunks_combine_to_the_whole():
    gen = torch.Generator().manual_seed(3)
    inv_freq = rope_inv_freq_for(8)
    queries, positions = torch.randn(2, 20, 8, generator=gen), torch.arange(20)
    whole = query_statistics(queries, positions, inv_freq)
    parts = combine_query_statistics([query_statistics(queries[:, :7], positions[:7], inv_freq),
                                      query_statistics(queries[:, 7:], positions[7:], inv_freq)])
    assert parts.count == 20
    torch.testing.assert_close(parts.center, whole.center)
    torch.testing.assert_close(parts.magnitude, whole.magnitude)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
def test_producer_statistics_are_the_models_pre_rope_queries(references, contexts, name):
    """The offline producer's centre is the mean of the model's own pre-RoPE queries (q_proj, or q_norm on Qwen3.5)."""
    ref, ids = references[name], contexts[name]
    signals = context_signals(ref, ids)
    attn = ref.model.model.layers[ref.attention_layer_ids[0]].self_attn
    head_dim, num_q_heads = signals.head_dim, signals.num_q_heads
    captured = []

    def record(_module, _inputs, output):
        captured.append(output[0].detach().reshape(len(ids), -1, head_dim).float())

    source = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
    hook = source.register_forward_hook(record)
    try:
        with torch.no_grad():
            ref.model(torch.tensor([ids]))
    finally:
        hook.remove()
    pre_rope = captured[0][:, :num_q_heads].transpose(0, 1)  # [Hq, n, D]
    stats = signals.query_statistics[0]
    assert len(signals.query_statistics) == signals.num_layers and stats.count == len(ids)
    torch.testing.assert_close(stats.center, pre_rope.mean(dim=1), atol=1e-4, rtol=1e-4)
    half = stats.inv_freq.shape[0]
    pair_norms = torch.hypot(pre_rope[..., :half], pre_rope[..., half : 2 * half]).mean(dim=1)
    torch.testing.assert_close(stats.magnitude[:, :half], pair_norms, atol=1e-4, rtol=1e-4)


# --- KVzip --------------------------------------------------------------------------------------


def test_reconstruction_inputs_follow_kvzip_chunking():
    context = list(range(100, 110))
    passes = reconstruction_inputs(context, [1, 2], [3], [9], protected_prefix_len=2, chunk_size=3, previous_tail=2)
    assert [(s, e) for s, e, _ in passes] == [(2, 5), (5, 8), (8, 10)]
    assert passes[0][2] == [1, 2, 9, 102, 103, 104]
    assert passes[1][2] == [3, 103, 104, 9, 105, 106, 107]  # continuation prompt + tail of the previous chunk
    assert passes[2][2] == [3, 106, 107, 9, 108, 109]
    assert [(s, e) for s, e, _ in reconstruction_inputs(context, [1], [3], [9])] == [(0, 10)]


def test_reconstruction_score_is_the_max_restricted_softmax():
    """Against explicit loops: softmax over prefix + chunk + the pass's causal keys, max over queries and group."""
    gen = torch.Generator().manual_seed(4)
    num_q_heads, num_kv_heads, head_dim, n, q_len = 4, 2, 8, 14, 5
    prefix, start, end = 2, 6, 10
    queries = torch.randn(num_q_heads, q_len, head_dim, generator=gen)
    keys = torch.randn(num_kv_heads, n + q_len, head_dim, generator=gen)
    total = accumulate_reconstruction_attention(torch.zeros(num_kv_heads, n), queries, keys, start, end,
                                                protected_prefix_len=prefix)
    expected = torch.zeros(num_kv_heads, n)
    for h in range(num_q_heads):
        kv = h // 2
        for t in range(q_len):
            visible = [*range(prefix), *range(start, end), *range(n, n + t + 1)]
            logits = {j: float(queries[h, t] @ keys[kv, j]) / math.sqrt(head_dim) for j in visible}
            norm = sum(math.exp(v) for v in logits.values())
            for j in [*range(prefix), *range(start, end)]:
                expected[kv, j] = max(expected[kv, j], math.exp(logits[j]) / norm)
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-5)
    assert (total[:, prefix:start] == 0).all() and (total[:, end:] == 0).all()  # other chunks: untouched


def test_the_entry_the_reconstruction_reads_scores_highest():
    gen = torch.Generator().manual_seed(5)
    head_dim, n, q_len = 8, 20, 6
    direction = torch.randn(head_dim, generator=gen)
    queries = direction.expand(2, q_len, head_dim) + 0.1 * torch.randn(2, q_len, head_dim, generator=gen)
    keys = 0.1 * torch.randn(1, n + q_len, head_dim, generator=gen)
    keys[0, 13] = 3 * direction
    total = accumulate_reconstruction_attention(torch.zeros(1, n), queries, keys, 0, n)
    assert total[0].argmax().item() == 13 and total[0, 13] > 0.5


def kvzip_brute_force(ref, context_ids, prompt, prefix, chunk_size):
    """Each pass as one plain forward of [context ; pass] with eager attention weights, renormalised over
    the columns KVzip's softmax sees (exact: a softmax restricted to a subset is the renormalised full one)."""
    n = len(context_ids)
    num_kv_heads = ref.model.config.num_key_value_heads
    totals = [torch.zeros(num_kv_heads, n) for _ in ref.attention_layer_ids]
    ref.model.set_attn_implementation("eager")
    try:
        for start, end, ids in reconstruction_inputs(context_ids, *prompt, protected_prefix_len=prefix, chunk_size=chunk_size):
            with torch.no_grad():
                out = ref.model(torch.tensor([context_ids + ids]), output_attentions=True)
            weights = [w for w in out.attentions if w is not None]
            assert len(weights) == len(totals)
            columns = [*range(prefix), *range(start, end), *range(n, n + len(ids))]
            for total, w in zip(totals, weights):
                probs = w[0, :, n:, columns].float()  # [Hq, q, visible]
                probs = probs / probs.sum(dim=-1, keepdim=True)
                best = probs[..., : prefix + end - start].amax(dim=1)  # over queries: [Hq, prefix + chunk]
                best = best.view(num_kv_heads, -1, best.shape[-1]).amax(dim=1)
                total[:, :prefix] = torch.maximum(total[:, :prefix], best[:, :prefix])
                total[:, start:end] = torch.maximum(total[:, start:end], best[:, prefix:])
    finally:
        ref.model.set_attn_implementation("sdpa")
    return totals


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
@pytest.mark.parametrize("prefix,chunk_size", [(0, 2000), (3, 17)])
def test_hf_reconstruction_pass_matches_the_models_attention(references, contexts, name, prefix, chunk_size):
    ref, ids = references[name], contexts[name]
    prompt = reconstruction_prompt_ids(ref.tokenizer)
    assert all(prompt) and prompt[2] == ref.tokenizer("\n<|assistant|>", add_special_tokens=False).input_ids
    scores = reconstruction_attention(ref, ids, protected_prefix_len=prefix, chunk_size=chunk_size)
    expected = kvzip_brute_force(ref, ids, prompt, prefix, chunk_size)
    assert len(scores) == len(ref.attention_layer_ids)
    for got, want in zip(scores, expected):
        assert got.shape == (ref.model.config.num_key_value_heads, len(ids)) and torch.isfinite(got).all()
        assert (got > 0).all() and (got <= 1).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# --- both policies through selection ------------------------------------------------------------


def test_both_are_offered_by_every_attention_model():
    for traits in (ModelTraits("LlamaForCausalLM", 4, 2, has_gdn=False, has_output_gate=False),
                   ModelTraits("Qwen3_5ForCausalLM", 1, 2, has_gdn=True, has_output_gate=True)):
        for name in ("triattention", "kvzip"):
            get_policy(name).check_model(traits)


def test_missing_signals_are_clear_errors(references, contexts):
    signals = context_signals(references["tiny-llama"], contexts["tiny-llama"], queries=False)
    assert signals.query_statistics is None and signals.reconstruction_attention is None
    with pytest.raises(ValueError, match="triattention.*needs ContextSignals.query_statistics"):
        get_policy("triattention")().score(signals, 0)
    with pytest.raises(ValueError, match="kvzip.*needs ContextSignals.reconstruction_attention"):
        get_policy("kvzip")().score(signals, 0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
def test_selection_keeps_the_prefix_and_each_policys_best(references, contexts, name):
    ref, ids = references[name], contexts[name]
    prefix = 4
    signals = context_signals(ref, ids, protected_prefix_len=prefix)
    signals.reconstruction_attention = reconstruction_attention(ref, ids, protected_prefix_len=prefix)
    n = len(ids)
    for policy_name in ("triattention", "kvzip"):
        policy = get_policy(policy_name)()
        keep = choose_keep_set(policy, signals, 0.25, allocation="flat")  # KVzip's own budgets: checked below
        budget = round(0.25 * (n - prefix))
        for layer, positions in enumerate(keep.positions):
            scores = policy.score(signals, layer)
            sinks = 4 if policy_name == "kvzip" else 0  # kvpress's n_sink: always kept
            assert scores.shape == (signals.num_kv_heads, n) and torch.isfinite(scores[:, sinks:]).all()
            assert (scores[:, :sinks] == float("inf")).all()
            assert positions.shape[0] == signals.num_kv_heads
            assert abs(positions.shape[1] - prefix - budget) <= 1
            for head in range(signals.num_kv_heads):
                kept = positions[head].tolist()
                assert kept[:prefix] == list(range(prefix))
                dropped = sorted(set(range(prefix, n)) - set(kept))
                assert scores[head, kept[prefix:]].min() >= scores[head, dropped].max()
    # KVzip's default: one threshold over every layer and KV head -- the heads keep different counts,
    # every kept score is at least every dropped one, model-wide, and the total is the flat one.
    policy = get_policy("kvzip")()
    keep = choose_keep_set(policy, signals, 0.25)
    assert keep.per_head and sum(map(sum, keep.kept_per_head)) == len(keep.positions) * signals.num_kv_heads * (prefix + budget)
    kept_min, dropped_max = float("inf"), float("-inf")
    for layer in range(keep.num_layers):
        scores, mask = policy.score(signals, layer), keep.mask(layer)
        assert mask[:, :prefix].all()
        kept_min = min(kept_min, float(scores[:, prefix:][mask[:, prefix:]].min()))
        dropped_max = max(dropped_max, float(scores[:, prefix:][~mask[:, prefix:]].max()))
    assert kept_min >= dropped_max
