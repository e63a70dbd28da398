"""GateSight pieces without a server: labels vs brute force, features, the scoring op, estimator files."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_kvx.gatesight.estimator import EstimatorMismatch, GateSightEstimator, model_fingerprint
from sglang_kvx.gatesight.features import AGE_FEATURES, age_features, all_layer_features, layer_features, num_features
from sglang_kvx.gatesight.labels import brute_force_change, leave_one_out_change, utility_labels
from sglang_kvx.ops.gatesight import mlp_utility, mlp_utility_reference
from sglang_kvx.signals import ContextSignals, GDNLayerSignals

from interpreter import interpreted_lines


def _attention_case(seed: int = 0, n: int = 40, t: int = 6, hq: int = 4, hkv: int = 2, d: int = 8, hidden: int = 16):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(hq, t, d, generator=gen) * 2
    keys = torch.randn(hkv, n + t, d, generator=gen) * 2
    values = torch.randn(hkv, n + t, d, generator=gen)
    o_proj = torch.randn(hidden, hq * d, generator=gen) / 4
    return queries, keys, values, o_proj, n, d**-0.5


def test_closed_form_matches_brute_force_deletion():
    queries, keys, values, o_proj, n, scaling = _attention_case()
    closed = leave_one_out_change(queries, keys, values, o_proj, n, scaling)  # [Hkv, T, n]
    worst = 0.0
    for kv_head in range(keys.shape[0]):
        scale = float(closed[kv_head].max())  # labels are max-normalised per layer and KV head
        for entry in range(n):
            brute = brute_force_change(queries, keys, values, o_proj, n, scaling, kv_head, entry)
            worst = max(worst, float((closed[kv_head, :, entry] - brute).abs().max()) / scale)
    assert worst < 1.4e-5, worst  # the paper's agreement, on the normalised scale of the labels
    assert float(closed.max()) > 1e-2  # the case is not trivially zero


def test_closed_form_sees_a_dominant_entry():
    queries, keys, values, o_proj, n, scaling = _attention_case(seed=1)
    keys[0, 7] = queries[0, 0] * 20  # query head 0 (KV head 0) attends almost only to entry 7
    values[0, 7] = 5.0
    labels = utility_labels([leave_one_out_change(queries, keys, values, o_proj, n, scaling)])
    assert labels.shape == (2, n)
    assert int(labels[0].argmax()) == 7
    assert torch.allclose(labels.amax(dim=1), torch.ones(2))


def _signals(n: int = 30, gdn_layers: int = 3, heads: int = 4, attention_layers: int = 2) -> ContextSignals:
    gen = torch.Generator().manual_seed(3)
    gdn = [GDNLayerSignals(beta=torch.rand(n, heads, generator=gen), g=-torch.rand(n, heads, generator=gen),
                           v_norm=torch.rand(n, heads, generator=gen) + 0.1) for _ in range(gdn_layers)]
    kv = [torch.randn(2, n, 8, generator=gen) for _ in range(attention_layers)]
    return ContextSignals(n=n, num_q_heads=4, num_kv_heads=2, head_dim=8, keys=kv, values=kv, gdn=gdn,
                          gdn_layer_of_attention=[1, 3][:attention_layers],
                          output_gate=[torch.full((n, 4), 0.3), torch.full((n, 4), 0.6)][:attention_layers])


def test_features_read_the_preceding_gdn_layers_and_age():
    signals = _signals()
    features = all_layer_features(signals, window=6)
    assert features.shape == (2, 30, num_features(4))
    # Attention layer 0 follows one GDN layer: the other five window slots are zero padding.
    assert torch.equal(features[0, :, : 5 * 12], torch.zeros(30, 60))
    assert torch.allclose(features[0, :, 60:72:3], signals.gdn[0].beta)
    assert torch.allclose(features[1, :, 36:48][:, 1::3], signals.gdn[0].g)
    assert torch.allclose(features[1, :, 60:72][:, 2::3], signals.gdn[2].v_norm.log())
    ages = age_features(30)
    assert torch.equal(features[1, :, -AGE_FEATURES:], ages)
    assert float(ages[-1, 0]) == 0.0 and float(ages[0, 2]) == 0.0
    for layer in range(2):  # one layer's features alone are the batched ones
        assert torch.equal(layer_features(signals, layer, window=6), features[layer])


def _random_mlp(layers=2, heads=2, features=75, units=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, heads, features, units, generator=gen) / 8, torch.randn(layers, heads, units, generator=gen),
            torch.randn(layers, heads, units, generator=gen), torch.randn(layers, heads, generator=gen))


def test_reference_op_is_the_per_estimator_mlp():
    w1, b1, w2, b2 = _random_mlp()
    x = torch.randn(2, 50, 75)
    out = mlp_utility_reference(x, w1, b1, w2, b2)
    assert out.shape == (2, 2, 50)
    for layer in range(2):
        for head in range(2):
            expected = torch.relu(x[layer] @ w1[layer, head] + b1[layer, head]) @ w2[layer, head] + b2[layer, head]
            assert torch.allclose(out[layer, head], expected, atol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        mlp_utility_reference(torch.randn(2, 50, 74), w1, b1, w2, b2)


def test_triton_kernel_matches_reference_under_the_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch; from sglang_kvx.ops.gatesight import mlp_utility, mlp_utility_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w1 = torch.randn(2, 2, 75, 64, generator=g) / 8; b1 = torch.randn(2, 2, 64, generator=g)\n"
        "w2 = torch.randn(2, 2, 64, generator=g); b2 = torch.randn(2, 2, generator=g)\n"
        "x = torch.randn(2, 130, 75, generator=g)\n"
        "got = mlp_utility(x, w1, b1, w2, b2, impl='triton'); want = mlp_utility_reference(x, w1, b1, w2, b2)\n"
        "print(float((got - want).abs().max()))\n"
    )
    lines = interpreted_lines(code, timeout=300)
    assert float(lines[-1]) < 1e-3


def test_triton_kernel_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w1, b1, w2, b2 = _random_mlp()
    with pytest.raises(RuntimeError, match="CUDA"):
        mlp_utility(torch.randn(2, 5, 75), w1, b1, w2, b2, impl="triton")


def test_estimator_round_trip_and_model_check(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    (model / "model.safetensors").write_bytes(b"weights-a")
    w1, b1, w2, b2 = _random_mlp()
    estimator = GateSightEstimator(w1, b1, w2, b2, feature_mean=torch.randn(2, 75), feature_std=torch.rand(2, 75) + 0.5,
                                   manifest={"model_name": "model", "model_fingerprint": model_fingerprint(model)})
    estimator.save(tmp_path / "est")
    loaded = GateSightEstimator.load(tmp_path / "est", model_path=model)
    x = torch.randn(2, 20, 75)
    assert torch.equal(loaded.score(x, impl="torch"), estimator.score(x, impl="torch"))
    # Folding the standardisation into w1/b1 equals standardising the input.
    standardised = (x - estimator.feature_mean[:, None]) / estimator.feature_std[:, None]
    assert torch.allclose(estimator.score(x, impl="torch"), mlp_utility_reference(standardised, w1, b1, w2, b2), atol=1e-4)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    (other / "model.safetensors").write_bytes(b"weights-b")
    with pytest.raises(EstimatorMismatch, match="was trained for model 'model'"):
        GateSightEstimator.load(tmp_path / "est", model_path=other)


def test_training_pipeline_writes_estimators_that_serve_only_their_model(tmp_path, demo_paths):
    """The real pipeline at toy size: labels from HF, MLP + baselines, held-out report, manifest."""
    from sglang_kvx.policies import get_policy
    from sglang_kvx.reference.hf import HFReference
    from sglang_kvx.reference.signals import context_signals
    from sglang_kvx.select import choose_keep_set
    from sglang_kvx.training.train_gatesight import main as train

    out = tmp_path / "estimator"
    report = train(["--model", demo_paths["tiny-hybrid-deep"], "--out", str(out), "--train-docs", "3",
                    "--heldout-docs", "2", "--lengths", "512", "--questions", "1", "--epochs", "1",
                    "--tasks", "niah_single_1,vt"])
    assert set(report) == {"mlp", "ridge", "best_single_signal", "age_only"}
    assert all(0.0 <= r["overlap_at_10"] <= 1.0 for r in report.values())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_name"] == "tiny-hybrid-deep" and manifest["num_attention_layers"] == 2
    assert manifest["heldout_report"] == report
    policy = get_policy("gatesight")(estimator=out, model_path=demo_paths["tiny-hybrid-deep"])
    ref = HFReference(demo_paths["tiny-hybrid-deep"])
    keep = choose_keep_set(policy, context_signals(ref, ref.encode("some words to keep " * 20)), 0.5)
    assert keep.num_layers == 2
    with pytest.raises(EstimatorMismatch):
        get_policy("gatesight")(estimator=out, model_path=demo_paths["tiny-llama"])


def test_labelled_documents_are_cached_and_reused_only_for_the_same_data(tmp_path, demo_paths, monkeypatch):
    """--docs-cache: a second run with the same data arguments labels nothing and trains the same
    estimator; other data arguments label again."""
    from sglang_kvx.training import train_gatesight

    args = ["--model", demo_paths["tiny-hybrid-deep"], "--train-docs", "2", "--heldout-docs", "1", "--lengths", "512",
            "--questions", "1", "--epochs", "2", "--tasks", "niah_single_1", "--loss", "listwise",
            "--docs-cache", str(tmp_path / "docs.pt")]
    first = train_gatesight.main(args + ["--out", str(tmp_path / "a")])
    assert (tmp_path / "docs.pt").is_file()
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["loss"] == "listwise"
    labelled = []
    real_build = train_gatesight.build_documents
    monkeypatch.setattr(train_gatesight, "build_documents", lambda *a, **k: labelled.append(a) or real_build(*a, **k))
    second = train_gatesight.main(args + ["--out", str(tmp_path / "b")])
    assert labelled == [] and second == first
    train_gatesight.main(args[:5] + ["3"] + args[6:] + ["--out", str(tmp_path / "c")])  # --heldout-docs 3
    assert len(labelled) == 2  # train and held-out documents labelled again


def _ranking_docs(count: int, seed: int):
    """Documents whose utility is a steep function of one feature column (plus noise columns)."""
    from sglang_kvx.training.train_gatesight import Document

    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(count):
        n = int(torch.randint(200, 400, (1,), generator=g))
        features = torch.randn(1, n, 5, generator=g)
        labels = (4 * features[0, :, 2]).exp()[None, None]  # [L=1, H=1, n]
        docs.append(Document(task="toy", features=features, labels=labels / labels.max(), gate_means=[]))
    return docs


def test_listwise_training_learns_the_within_document_ranking():
    """The listwise loss recovers a steep, heavy-tailed utility's top entries (MSE on the same
    labels reaches about half: it fits the many near-zero labels instead)."""
    from sglang_kvx.training.train_gatesight import overlap_at, train_mlp

    loss = "listwise"
    estimator = train_mlp(_ranking_docs(20, 0), None, epochs=40, seed=0, loss=loss)
    heldout = _ranking_docs(5, 1)
    overlaps = [float(overlap_at(estimator.score(d.features, impl="torch")[0, 0], d.labels[0, 0])) for d in heldout]
    assert sum(overlaps) / len(overlaps) > 0.9
    untrained = train_mlp(_ranking_docs(20, 0), None, epochs=0, seed=0, loss=loss)
    assert sum(float(overlap_at(untrained.score(d.features, impl="torch")[0, 0], d.labels[0, 0])) for d in heldout) / 5 < 0.6


def test_unknown_estimator_loss_is_refused():
    from sglang_kvx.training.train_gatesight import train_mlp

    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        train_mlp(_ranking_docs(2, 0), None, epochs=1, seed=0, loss="hinge")


def test_per_layer_scores_equal_the_batched_op(tmp_path):
    w1, b1, w2, b2 = _random_mlp(features=num_features(4))
    estimator = GateSightEstimator(w1, b1, w2, b2, feature_mean=torch.zeros(2, num_features(4)),
                                   feature_std=torch.ones(2, num_features(4)), manifest={"gdn_window": 6})
    from sglang_kvx.policies.gatesight import GateSightPolicy

    policy = GateSightPolicy(estimator=estimator, impl="torch")
    signals = _signals()
    batched = policy.score_layers(signals, [5, 5])
    for layer in range(2):
        assert torch.allclose(policy.score(signals, layer), batched[layer], atol=1e-5)


def test_a_long_context_is_scored_a_few_layers_at_a_time(monkeypatch):
    """Under a feature-byte cap the layers are scored in groups (never every layer's features at
    once), with the scores of one batched op over all of them."""
    import sglang_kvx.policies.gatesight as gatesight_module
    from sglang_kvx.gatesight.features import layer_groups

    w1, b1, w2, b2 = _random_mlp(features=num_features(4))
    estimator = GateSightEstimator(w1, b1, w2, b2, feature_mean=torch.zeros(2, num_features(4)),
                                   feature_std=torch.ones(2, num_features(4)), manifest={"gdn_window": 6})
    policy = gatesight_module.GateSightPolicy(estimator=estimator, impl="torch")
    signals = _signals()
    one_layer = signals.n * num_features(4) * 4
    assert layer_groups(signals, 10 * one_layer) == [range(0, 2)]
    assert layer_groups(signals, one_layer) == [range(0, 1), range(1, 2)]
    assert layer_groups(signals, 1) == [range(0, 1), range(1, 2)]  # at least one layer per group
    together = policy.score_layers(signals, [5, 5])
    monkeypatch.setattr(gatesight_module, "FEATURE_BYTES", one_layer)
    apart = policy.score_layers(signals, [5, 5])
    full = estimator.score(all_layer_features(signals, window=6), impl="torch")
    for layer in range(2):
        assert torch.equal(together[layer], full[layer])
        assert torch.allclose(apart[layer], full[layer], atol=1e-6)


class _Pool:
    num_layers = 2


class _Batch:
    is_extend, is_decode = True, False

    def __init__(self, segments):
        self.segments = segments


def _record_in_chunks(recorder, signals, chunks, skip_gdn_layer=None, gates=None):
    """Drive the recorder as a hybrid's prefill would: model layers 0, 2, 3 are GDN, 1 and 4 attention
    (one GDN layer before attention layer 0, three before attention layer 1, as in ``_signals``)."""
    from sglang_kvx.ports import Segment

    for start, length in chunks:
        batch = _Batch([Segment(index=0, row=5, start=0, length=length, prefix_len=start)])
        recorder.expect(batch)  # the adapter tells it each forward batch's tokens, from outside the forward
        part = slice(start, start + length)
        for model_layer in range(5):
            if model_layer in (1, 4):
                layer = (1, 4).index(model_layer)
                recorder.attention(layer, torch.empty(length, 32), batch, 4, 8, 0.3)
                if gates is not None:  # the gate projection's logits [t, 4 heads x 8]
                    recorder.output_gate(layer, gates[layer][part], batch, 4)
            elif model_layer != skip_gdn_layer:
                gdn = signals.gdn[(0, 2, 3).index(model_layer)]
                # ||v|| of a one-dimensional v is its magnitude: the recorder sees the layer's real norm.
                recorder.gdn_signals(model_layer, 5, gdn.beta[part], gdn.g[part], gdn.v_norm[part, :, None])
    return recorder.take(5)


def test_the_server_scores_a_prefill_chunk_by_chunk_as_the_whole_context_would_be():
    """GateSight on one rank is scored inside the prefill, chunk by chunk (every feature is the
    token's own): the scores equal scoring the whole recorded context, and the recording never
    holds more than its scores and one chunk's signals of the GDN layers still to be read."""
    from sglang_kvx.policies.gatesight import GateSightPolicy
    from sglang_kvx.signals import CaptureSpec
    from sglang_kvx.signals.recorder import SignalRecorder

    w1, b1, w2, b2 = _random_mlp(features=num_features(4))
    estimator = GateSightEstimator(w1, b1, w2, b2, feature_mean=torch.rand(2, num_features(4)),
                                   feature_std=torch.rand(2, num_features(4)) + 0.5, manifest={"gdn_window": 6})
    policy = GateSightPolicy(estimator=estimator, impl="torch")
    whole = _signals(n=300)
    expected = policy.score_layers(whole, [5, 5])

    recorder = SignalRecorder(_Pool(), 4, lambda: None, gdn_layer_ids=[0, 2, 3], attention_layer_ids=[1, 4])
    recorder.start(5, 300, CaptureSpec(gdn=True), policy.chunk_scoring())
    recording = _record_in_chunks(recorder, whole, [(0, 64), (64, 64), (128, 100), (228, 72)])
    assert recording.failed is None and not recording.state("gdn").chunks  # every GDN chunk dropped once read
    streamed = ContextSignals(n=300, num_q_heads=4, num_kv_heads=2, head_dim=8, keys=whole.keys, values=whole.values)
    recording.fill(streamed)
    assert not streamed.gdn and streamed.gdn_layer_of_attention == [1, 3]
    for layer in range(2):
        assert torch.allclose(policy.score_layers(streamed, [5, 5])[layer], expected[layer], atol=1e-5)
        assert torch.allclose(policy.score(streamed, layer), expected[layer], atol=1e-5)
    whole_gdn_bytes = sum(t.numel() * 4 for g in whole.gdn for t in (g.beta, g.g, g.v_norm))
    one_chunk = 3 * 100 * 4 * 3 * 4  # the largest chunk's beta, g, ||v|| of every GDN layer
    scores = 2 * 2 * 300 * 4
    assert recording.peak_nbytes() <= scores + one_chunk < whole_gdn_bytes

    # The output gates are held as each head's running sum: the gate allocation's budgets are the ones
    # every token's gate gives.
    from sglang_kvx.allocate import layer_budgets

    logits = [torch.randn(300, 32, generator=torch.Generator().manual_seed(layer)) + 3.0 * layer - 2.0 for layer in range(2)]
    recorder.start(5, 300, CaptureSpec(gdn=True, output_gate=True), policy.chunk_scoring())
    gated = _record_in_chunks(recorder, whole, [(0, 64), (64, 236)], gates=logits)
    assert all(total.shape == (4,) for total, _ in gated.state("output_gate")["sums"].values())
    gated.fill(streamed)
    per_token = [torch.sigmoid(g.reshape(300, 4, 8)).mean(-1) for g in logits]
    for layer in range(2):
        assert torch.allclose(streamed.output_gate[layer], per_token[layer].mean(0, keepdim=True), atol=1e-6)
    whole.output_gate = per_token
    for p in (0.3, 0.1, 0.05):
        budgets = layer_budgets("gate", p, 300, 2, streamed)
        assert budgets == layer_budgets("gate", p, 300, 2, whole) and budgets[0] < budgets[1]

    # Under tensor parallelism (no chunk scoring) the signals are held whole, as before.
    recorder.start(5, 300, CaptureSpec(gdn=True))
    held = _record_in_chunks(recorder, whole, [(0, 150), (150, 150)])
    assert held.peak_nbytes() == whole_gdn_bytes

    # A GDN layer whose chunk never arrived fails this recording (with the reason), not the forward.
    recorder.start(5, 300, CaptureSpec(gdn=True), policy.chunk_scoring())
    broken = _record_in_chunks(recorder, whole, [(0, 300)], skip_gdn_layer=3)
    assert broken.failed is not None and "GDN layer 3" in broken.failed
