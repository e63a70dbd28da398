"""KVzap (issue #57): the surrogate files, their refusals, and the policy's keep-sets from HF's hidden
states (threshold and budget modes), checked against the rule written out here."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_kvx.policies import get_policy
from sglang_kvx.policies.kvzap import KVzapSurrogate, SurrogateMismatch, find_surrogate
from sglang_kvx.reference.kvzap import attention_inputs
from sglang_kvx.reference.signals import context_signals
from sglang_kvx.select import choose_keep_set
from sglang_kvx.signals import CaptureSpec


def random_surrogate(ref, kind: str, seed: int = 0, threshold: float = 0.0) -> KVzapSurrogate:
    """A surrogate of the model's shapes with random weights, its manifest naming the checkpoint."""
    from sglang_kvx.gatesight.estimator import config_hash, model_fingerprint

    config = ref.model.config
    gen = torch.Generator().manual_seed(seed)
    d, h, width = config.hidden_size, config.num_key_value_heads, config.hidden_size // 8
    if kind == "linear":
        layers = [{"weight": torch.randn(h, d, generator=gen) / d ** 0.5, "bias": torch.randn(h, generator=gen)}
                  for _ in ref.attention_layer_ids]
    else:
        layers = [{"w1": torch.randn(width, d, generator=gen) / d ** 0.5, "b1": torch.randn(width, generator=gen),
                   "w2": torch.randn(h, width, generator=gen) / width ** 0.5, "b2": torch.randn(h, generator=gen)}
                  for _ in ref.attention_layer_ids]
    manifest = {"model_name": "test", "model_fingerprint": model_fingerprint(ref.model_path),
                "config_hash": config_hash(ref.model_path), "threshold": threshold}
    return KVzapSurrogate(kind, layers, manifest)


@pytest.fixture(scope="module")
def context(references):
    return references["tiny-llama"].encode("red blue green river mountain forest sea sky " * 24)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_files_round_trip_in_kvpress_layout(references, tmp_path, kind):
    ref = references["tiny-llama"]
    surrogate = random_surrogate(ref, kind, seed=1)
    surrogate.save(tmp_path / kind)
    config = json.loads((tmp_path / kind / "config.json").read_text())
    d = ref.model.config.hidden_size
    assert config["model_type"] == "kvzap" and config["input_dim"] == d and config["n_modules"] == 4
    assert config["output_dim"] == 2 and config["hidden_dim"] == (None if kind == "linear" else d // 8)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / kind / "model.safetensors")))
    assert ("layers.3.weight" in keys) == (kind == "linear") and ("layers.3.2.bias" in keys) == (kind == "mlp")
    loaded = KVzapSurrogate.load(tmp_path / kind, model_path=ref.model_path)
    hidden = torch.randn(5, d)
    torch.testing.assert_close(loaded.score(2, hidden), surrogate.score(2, hidden))
    # the score is the module written out: Linear(D, H), or Linear -> exact GELU -> Linear
    p = surrogate.layers[2]
    if kind == "linear":
        expected = hidden @ p["weight"].T + p["bias"]
    else:
        expected = torch.nn.GELU()(hidden @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
    torch.testing.assert_close(surrogate.score(2, hidden), expected.T)


def test_a_surrogate_for_another_checkpoint_or_none_is_refused(references, demo_paths, tmp_path):
    surrogate = random_surrogate(references["tiny-llama"], "mlp")
    surrogate.save(tmp_path / "mlp")
    with pytest.raises(SurrogateMismatch, match="config.json differs.*train_kvzap --model"):
        KVzapSurrogate.load(tmp_path / "mlp", model_path=demo_paths["tiny-hybrid-deep"])
    with pytest.raises(SurrogateMismatch, match="holds no KVzap surrogate"):
        KVzapSurrogate.load(tmp_path / "nothing", model_path=demo_paths["tiny-llama"])
    from sglang_kvx.models.demo import weights_root

    with pytest.raises(SurrogateMismatch, match="no KVzap linear surrogate was trained for"):
        find_surrogate(weights_root() / "tiny-llama-ruler", "linear")  # a checkpoint none is shipped for
    with pytest.raises(SurrogateMismatch, match="reads a linear surrogate"):
        get_policy("kvzap_linear")(surrogate=surrogate)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_threshold_mode_keeps_what_reaches_tau_and_the_window(references, context, kind):
    """Each (layer, KV head) keeps exactly the entries whose predicted score >= tau, plus the last
    ``window`` -- the paper's rule, written out here from the surrogate and HF's hidden states."""
    ref = references["tiny-llama"]
    surrogate = random_surrogate(ref, kind, seed=2)
    hidden = attention_inputs(ref, context)
    scores = [surrogate.score(layer, h) for layer, h in enumerate(hidden)]
    tau = float(torch.cat([s.flatten() for s in scores]).median()) + 1e-3  # off every score: no float ties
    policy = get_policy("kvzap" if kind == "mlp" else "kvzap_linear")(surrogate=surrogate, threshold=tau, window=16)
    signals = context_signals(ref, context, signals=CaptureSpec(hidden_states=2))
    keep = choose_keep_set(policy, signals, 1.0)
    n = len(context)
    assert keep.per_head
    for layer in range(keep.num_layers):
        expected = scores[layer] >= tau
        expected[:, n - 16 :] = True
        assert torch.equal(keep.mask(layer), expected)
    kept = sum(map(sum, keep.kept_per_head)) / (n * keep.num_layers * 2)
    assert 0.45 < kept < 0.75  # about half reach the median, plus the window


def test_budget_mode_is_one_threshold_over_every_layer_and_head(references, context):
    ref = references["tiny-llama"]
    policy = get_policy("kvzap")(surrogate=random_surrogate(ref, "mlp", seed=3), threshold=0.0, window=16)
    signals = context_signals(ref, context, signals=CaptureSpec(hidden_states=2))
    n = len(context)
    keep = choose_keep_set(policy, signals, 0.3, allocation="global")
    assert sum(map(sum, keep.kept_per_head)) == 4 * 2 * round(0.3 * n)
    kept_min, dropped_max = float("inf"), float("-inf")
    for layer in range(keep.num_layers):
        scores, mask = policy.score(signals, layer), keep.mask(layer)
        assert mask[:, n - 16 :].all()
        kept_min = min(kept_min, float(scores[mask].min()))
        dropped_max = max(dropped_max, float(scores[~mask].max()))
    assert kept_min >= dropped_max


def test_the_window_belongs_to_the_threshold_rule_and_a_budget_has_none_unless_given(references, context):
    """With no window given, the threshold rule keeps the paper's 128 last tokens and a budget keeps the
    best raw surrogate scores under one threshold, the last tokens competing like the rest (a window
    counted in a budget of 10% would take all of it); a window given is kept under a budget too."""
    ref = references["tiny-llama"]
    surrogate = random_surrogate(ref, "mlp", seed=6)
    signals = context_signals(ref, context, signals=CaptureSpec(hidden_states=2))
    raw = [surrogate.score(layer, h) for layer, h in enumerate(attention_inputs(ref, context))]
    n = len(context)
    assert n > 128
    default = get_policy("kvzap")(surrogate=surrogate, threshold=1e6)  # no score reaches tau: the window only
    keep = choose_keep_set(default, signals, 1.0)
    for layer in range(keep.num_layers):
        assert keep.mask(layer)[:, n - 128 :].all() and not keep.mask(layer)[:, : n - 128].any()
    keep = choose_keep_set(default, signals, 0.1, allocation="global")
    assert sum(map(sum, keep.kept_per_head)) == 4 * 2 * round(0.1 * n)
    kept = torch.cat([raw[layer][keep.mask(layer)] for layer in range(keep.num_layers)])
    dropped = torch.cat([raw[layer][~keep.mask(layer)] for layer in range(keep.num_layers)])
    assert kept.min() >= dropped.max()
    assert not all(keep.mask(layer)[:, n - 16 :].all() for layer in range(keep.num_layers))
    given = get_policy("kvzap")(surrogate=surrogate, threshold=1e6, window=16)
    keep = choose_keep_set(given, signals, 0.1, allocation="global")
    assert all(keep.mask(layer)[:, n - 16 :].all() for layer in range(keep.num_layers))


def test_chunk_scores_equal_whole_context_scores(references, context):
    """What the server streams chunk by chunk (``ChunkScoring.hidden``) is the whole context's score."""
    ref = references["tiny-llama"]
    policy = get_policy("kvzap")(surrogate=random_surrogate(ref, "mlp", seed=4), threshold=0.0, window=0)
    hidden = attention_inputs(ref, context)
    signals = context_signals(ref, context, signals=CaptureSpec(hidden_states=2))
    for layer, h in enumerate(hidden):
        streamed = torch.cat([policy.chunk_scoring().hidden(layer, h[a : a + 50]) for a in range(0, len(context), 50)], -1)
        torch.testing.assert_close(streamed, policy.score(signals, layer))


def test_threshold_allocation_needs_a_threshold(references, context):
    ref = references["tiny-llama"]
    signals = context_signals(ref, context)
    with pytest.raises(ValueError, match="needs a policy that gives a threshold"):
        choose_keep_set(get_policy("keydiff")(), signals, 0.5, allocation="threshold")


def test_a_tensor_parallel_rank_scores_its_own_heads(references, context):
    """Each rank holds the whole hidden states and keeps its own KV heads: the threshold decides each
    head alone, so a rank's keep-set is the whole model's for its heads."""
    import copy

    ref = references["tiny-llama"]
    policy = get_policy("kvzap")(surrogate=random_surrogate(ref, "mlp", seed=5), threshold=0.0, window=16)
    signals = context_signals(ref, context, signals=CaptureSpec(hidden_states=2))
    whole = choose_keep_set(policy, signals, 1.0)
    rank = copy.copy(signals)
    rank.num_kv_heads, rank.kv_heads = 1, (1, 2)
    rank.keys = [k[1:] for k in signals.keys]
    rank.values = [v[1:] for v in signals.values]
    own = choose_keep_set(policy, rank, 1.0)
    for layer in range(whole.num_layers):
        assert torch.equal(own.mask(layer), whole.mask(layer)[1:])
    rank.kv_heads = None  # a context that does not say which heads it holds is refused, not misread
    with pytest.raises(ValueError, match="surrogate covers 4 attention layers x 2 KV heads"):
        policy.score(rank, 0)


def test_a_server_without_a_surrogate_for_its_model_refuses_by_name(demo_paths):
    """At launch (--kvx-policy kvzap, --kvx-decode kvzap) and per decode request (the step's
    load_resources: StepUnavailable): the checkpoint without a surrogate is named with the command that
    trains one, and so is a --kvx-kvzap-surrogates folder trained for another checkpoint."""
    from sglang_kvx.config import KvxConfigError, build_config
    from sglang_kvx.decode import DECODE_STEPS
    from sglang_kvx.decode.base import StepUnavailable
    from sglang_kvx.models.demo import weights_root

    ruler = str(weights_root() / "tiny-llama-ruler")  # a dense checkpoint no surrogate is shipped for
    with pytest.raises(KvxConfigError, match="no KVzap mlp surrogate was trained for .*train_kvzap --model"):
        build_config("kvzap", "0.5", ruler)
    with pytest.raises(KvxConfigError, match="--kvx-decode kvzap_linear: no KVzap linear surrogate"):
        build_config("none", "1.0", ruler, decode="kvzap_linear")
    config = build_config("none", "1.0", demo_paths["tiny-llama"], decode_steps="on")
    assert DECODE_STEPS["kvzap"].load_resources(config).num_layers == 4
    other = build_config("none", "1.0", demo_paths["tiny-llama"], decode_steps="on",
                         kvzap_surrogates=str(weights_root() / "kvzap" / "tiny-hybrid-deep"))
    with pytest.raises(StepUnavailable, match="trained for model 'tiny-hybrid-deep'"):
        DECODE_STEPS["kvzap"].load_resources(other)
    assert build_config("kvzap", "1.0", demo_paths["tiny-llama"], kvzap_threshold="-5", kvzap_window="64").kvzap_window == 64
    with pytest.raises(KvxConfigError, match="--kvx-kvzap-threshold must be a finite number"):
        build_config("kvzap", "1.0", demo_paths["tiny-llama"], kvzap_threshold="nan")
