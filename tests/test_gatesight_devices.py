"""GateSight training on any device and dtype, and the manifest's config hash at start-up.

``train_gatesight --device cpu --dtype float32`` must train the estimator the trainer trained
before it took devices: ``tests/data/gatesight_pre_gpu`` holds that estimator and its documents'
labels, written by the pre-change trainer (commit 2d19a9b) with ``GOLDEN_ARGS`` below.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_kvx.gatesight.estimator import (
    EstimatorMismatch,
    GateSightEstimator,
    config_hash,
    find_estimator,
    model_fingerprint,
    train_command,
)
from sglang_kvx.gatesight.labels import leave_one_out_change, utility_labels
from sglang_kvx.training import train_gatesight

GOLDEN = Path(__file__).parent / "data" / "gatesight_pre_gpu"
GOLDEN_ARGS = ["--train-docs", "2", "--heldout-docs", "1", "--lengths", "512", "--questions", "2", "--epochs", "3",
               "--tasks", "niah_single_1,vt"]
TRAIN_MODULE = "python -m sglang_kvx.training.train_gatesight"


def _train(tmp_path: Path, model: str, name: str, *extra: str) -> tuple[Path, dict]:
    """One run of the trainer at golden size; returns the estimator folder and its documents."""
    out, cache = tmp_path / name, tmp_path / f"{name}.pt"
    train_gatesight.main(["--model", model, "--out", str(out), "--docs-cache", str(cache), *GOLDEN_ARGS, *extra])
    return out, torch.load(cache, weights_only=True)


def _assert_same_estimator(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in ("w1", "b1", "w2", "feature_mean", "feature_std"):
        # rtol as the labels' (another CPU's rounding, carried through six Adam steps)
        assert torch.allclose(a[name], b[name], rtol=1e-3, atol=1e-4), (name, (a[name] - b[name]).abs().max())
    # b2 shifts every score of a (layer, head) alike: the listwise loss (a softmax over one document)
    # has zero gradient for it up to rounding, which Adam scales into lr-sized steps. It moves
    # rankings not at all; bound it by lr * steps (3e-3 * 6).
    assert torch.allclose(a["b2"], b["b2"], atol=0.02)


def _sessions(ref, count: int, length: int, questions: int, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    from sglang_kvx.eval import generate_session

    rng = random.Random(seed)
    items = []
    for i in range(count):
        task = ("niah_single_1", "vt", "qa_1")[i % 3]
        session = generate_session(task, length + 64 * i, num_questions=questions, seed=train_gatesight.TRAIN_SEED_BASE,
                                   index=rng.randrange(10**6), tokenizer=ref.tokenizer)
        context = ref.tokenizer(session.context).input_ids
        items.append((context, [ref.tokenizer(t.question).input_ids + ref.tokenizer(" " + ", ".join(t.answers)).input_ids
                                for t in session.turns]))
    return items


# --- the trainer on --device cpu --------------------------------------------------------------


def test_cpu_float32_estimators_equal_the_pre_gpu_trainers(tmp_path, demo_paths):
    """Same labels (unbatched and batched 3 sequences a forward), same estimator, same report as the
    trainer before --device; the manifest gains the config hash and the label dtype."""
    model = demo_paths["tiny-hybrid-deep"]
    golden_labels = load_file(str(GOLDEN / "labels.safetensors"))
    golden = load_file(str(GOLDEN / "estimator.safetensors"))
    excerpt = json.loads((GOLDEN / "manifest_excerpt.json").read_text())
    assert excerpt["model_fingerprint"] == model_fingerprint(model)  # the demo model the fixture was made from
    for name, extra in (("unbatched", ()), ("batched", ("--batch-size", "3"))):
        out, docs = _train(tmp_path, model, name, "--device", "cpu", "--dtype", "float32", *extra)
        for split in ("train", "heldout"):
            for i, doc in enumerate(docs[split]):
                assert doc["labels"].dtype == torch.float32 and doc["features"].device.type == "cpu"
                # The golden labels were written on our machine; CI's CPU rounds float32 reductions with
                # another SIMD width, and each label is a difference of attention outputs over its head's maximum, so
                # rounding reaches ~2e-4 there (measured on CI). A real labelling change moves them by far more.
                torch.testing.assert_close(doc["labels"], golden_labels[f"{split}{i}.labels"], rtol=1e-3, atol=2e-4)
                torch.testing.assert_close(doc["features"].double().sum(dim=1).float(),
                                           golden_labels[f"{split}{i}.feature_sums"], rtol=1e-4, atol=1e-3)
        _assert_same_estimator(load_file(str(out / "estimator.safetensors")), golden)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["config_hash"] == config_hash(model) and manifest["label_dtype"] == "float32", name
        assert manifest["best_single_signal_columns"] == excerpt["best_single_signal_columns"], name
        for predictor, metrics in excerpt["heldout_report"].items():
            for metric, value in metrics.items():
                assert manifest["heldout_report"][predictor][metric] == pytest.approx(value, abs=0.02), (name, predictor, metric)


def test_batched_labels_equal_one_forward_per_continuation(references):
    """label_documents (padded batches, across documents of different lengths) against
    label_document (one forward per continuation) and against the labels computed by hand
    from context_signals with leave_one_out_change."""
    from sglang_kvx.reference.signals import context_signals

    ref = references["tiny-hybrid-deep"]
    items = _sessions(ref, 3, 384, questions=2)
    assert len({len(c) for c, _ in items}) == 3  # padding is exercised
    unbatched = [train_gatesight.label_document(ref, context, continuations) for context, continuations in items]
    for batch_size in (1, 3, 4):
        batched = train_gatesight.label_documents(ref, items, batch_size=batch_size)
        for one, many in zip(unbatched, batched):
            torch.testing.assert_close(many.labels, one.labels, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(many.features, one.features, rtol=1e-4, atol=1e-5)
            assert many.gate_means == pytest.approx(one.gate_means, abs=1e-6)
    context, continuations = items[0]
    by_hand = []
    for layer, layer_id in enumerate(ref.attention_layer_ids):
        attn = ref.model.model.layers[layer_id].self_attn
        changes = []
        for continuation in continuations:
            s = context_signals(ref, context + continuation, window=len(continuation), column_sums=False)
            changes.append(leave_one_out_change(s.window_queries[layer], s.keys[layer], s.values[layer],
                                                attn.o_proj.weight.detach(), len(context), attn.scaling))
        by_hand.append(utility_labels(changes))
    torch.testing.assert_close(unbatched[0].labels, torch.stack(by_hand), rtol=1e-5, atol=1e-6)


def test_bfloat16_labels_are_float32_and_rank_like_float32_ones(demo_paths):
    """A bf16 model labels in float32 (features too); its labels rank the context like the float32
    model's (Spearman > 0.99, overlap@10% >= 0.9 per layer and head; measured: >= 0.999, >= 0.975)
    without being the same labels. The same check on mismatched documents fails (the control)."""
    from sglang_kvx.reference.hf import HFReference

    ref32 = HFReference(demo_paths["tiny-hybrid-deep"])
    ref16 = HFReference(demo_paths["tiny-hybrid-deep"], dtype=torch.bfloat16)
    items = _sessions(ref32, 2, 384, questions=2)
    full = train_gatesight.label_documents(ref32, items, batch_size=2)
    half = train_gatesight.label_documents(ref16, items, batch_size=2)
    assert ref16.model.dtype == torch.bfloat16

    def agrees(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (train_gatesight.spearman(a, b) > 0.99
                and float(train_gatesight.overlap_at(b, a)) >= 0.9)

    for f, h in zip(full, half):
        assert h.labels.dtype == torch.float32 and h.features.dtype == torch.float32
        assert torch.isfinite(h.labels).all() and torch.isfinite(h.features).all()
        assert not torch.equal(f.labels, h.labels)  # the bf16 forward did run
        for layer in range(f.labels.shape[0]):
            for head in range(f.labels.shape[1]):
                assert agrees(f.labels[layer, head], h.labels[layer, head]), (layer, head)
    n = min(full[0].labels.shape[2], half[1].labels.shape[2])
    assert not any(agrees(full[0].labels[l, h, :n], half[1].labels[l, h, :n]) for l in range(2) for h in range(2))


# --- refusals of the trainer --------------------------------------------------------------------


def _refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        train_gatesight.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused(capsys, demo_paths):
    err = _refusal(capsys, ["--model", demo_paths["tiny-hybrid-deep"], "--device", "cuda"])
    assert "--device cuda: CUDA is not available on this machine" in err and "use --device cpu" in err


def test_unusable_arguments_are_refused(capsys, demo_paths, tmp_path):
    hybrid = demo_paths["tiny-hybrid-deep"]
    assert "is not a torch device" in _refusal(capsys, ["--model", hybrid, "--device", "gpu0"])
    err = _refusal(capsys, ["--model", demo_paths["tiny-llama"]])
    assert "LlamaForCausalLM is not a supported hybrid checkpoint" in err and "it has no GDN layers" in err
    assert "no config.json there" in _refusal(capsys, ["--model", str(tmp_path / "missing")])
    assert "--batch-size must be >= 1, got 0" in _refusal(capsys, ["--model", hybrid, "--batch-size", "0"])
    assert "invalid choice: 'int8'" in _refusal(capsys, ["--model", hybrid, "--dtype", "int8"])
    broken = tmp_path / "broken"  # a hybrid config with no weights behind it
    broken.mkdir()
    shutil.copy(Path(hybrid) / "config.json", broken / "config.json")
    assert "transformers cannot load it" in _refusal(capsys, ["--model", str(broken)])


# --- the manifest's config hash -----------------------------------------------------------------


def _checkpoint(root: Path, config: dict, weights: bytes = b"weights-a") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "model.safetensors").write_bytes(weights)
    return root


def _estimator_for(model: Path, out: Path, **manifest) -> Path:
    estimator = GateSightEstimator(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1),
                                   torch.zeros(1, 4), torch.ones(1, 4), manifest={
                                       "model_name": model.name, "model_fingerprint": model_fingerprint(model),
                                       "config_hash": config_hash(model), **manifest})
    return estimator.save(out)


def test_config_hash_ignores_formatting_and_tells_config_from_weights(tmp_path):
    config = {"model_type": "qwen3_5_text", "num_hidden_layers": 4}
    model = _checkpoint(tmp_path / "model", config)
    reformatted = _checkpoint(tmp_path / "reformatted", dict(reversed(list(config.items()))))
    assert config_hash(model) == config_hash(reformatted) and model_fingerprint(model) != model_fingerprint(reformatted)
    est = _estimator_for(model, tmp_path / "est")
    GateSightEstimator.load(est, model_path=model)

    other_config = _checkpoint(tmp_path / "deeper", {**config, "num_hidden_layers": 8})
    with pytest.raises(EstimatorMismatch, match=r"whose config.json differs from .*deeper's \(config hash") as exc:
        GateSightEstimator.load(est, model_path=other_config)
    assert f"train one with: {TRAIN_MODULE} --model {other_config}" in str(exc.value)

    other_weights = _checkpoint(tmp_path / "finetuned", config, weights=b"weights-b")
    with pytest.raises(EstimatorMismatch, match="the same config.json but other weights") as exc:
        GateSightEstimator.load(est, model_path=other_weights)
    assert "config.json differs" not in str(exc.value)

    # An edited manifest whose config hash disagrees with the fingerprinted config is refused too.
    manifest = json.loads((est / "manifest.json").read_text())
    (est / "manifest.json").write_text(json.dumps({**manifest, "config_hash": "0" * 64}))
    with pytest.raises(EstimatorMismatch, match="config.json differs"):
        GateSightEstimator.load(est, model_path=model)


def test_manifests_without_a_config_hash_still_load(tmp_path, demo_paths):
    model = _checkpoint(tmp_path / "model", {"model_type": "qwen3_5_text"})
    est = _estimator_for(model, tmp_path / "est")
    manifest = json.loads((est / "manifest.json").read_text())
    del manifest["config_hash"]
    (est / "manifest.json").write_text(json.dumps(manifest))
    GateSightEstimator.load(est, model_path=model)
    assert find_estimator(model, search_roots=[tmp_path]) == est
    other = _checkpoint(tmp_path / "other", {"model_type": "qwen3_5_text"}, weights=b"weights-b")
    with pytest.raises(EstimatorMismatch, match=r"trained for model 'model' \(fingerprint") as exc:
        GateSightEstimator.load(est, model_path=other)
    assert "other weights" not in str(exc.value)  # without a config hash it cannot say which differs
    # The shipped estimator records its model's config hash.
    shipped = json.loads((Path(demo_paths["tiny-hybrid-deep"]).parent / "gatesight" / "tiny-hybrid-deep" / "manifest.json").read_text())
    assert shipped["config_hash"] == config_hash(demo_paths["tiny-hybrid-deep"])


def test_find_estimator_names_estimators_of_the_same_config(tmp_path):
    config = {"model_type": "qwen3_5_text", "num_hidden_layers": 4}
    base = _checkpoint(tmp_path / "base", config)
    _estimator_for(base, tmp_path / "estimators" / "base")
    assert find_estimator(base, search_roots=[tmp_path / "estimators"]) == tmp_path / "estimators" / "base"
    finetuned = _checkpoint(tmp_path / "finetuned", config, weights=b"weights-b")
    with pytest.raises(EstimatorMismatch, match="fit this config but were trained on other weights") as exc:
        find_estimator(finetuned, search_roots=[tmp_path / "estimators"])
    assert f"train one with: {TRAIN_MODULE} --model {finetuned} (or pass --kvx-estimator DIR)" in str(exc.value)


def test_the_training_command_names_a_gpu_for_a_large_checkpoint(tmp_path):
    small = _checkpoint(tmp_path / "small", {"model_type": "qwen3_5_text", "dtype": "bfloat16"})
    assert train_command(small) == f"{TRAIN_MODULE} --model {small}"
    large = _checkpoint(tmp_path / "large", {"text_config": {"model_type": "qwen3_5_text", "dtype": "float16"}})
    with (large / "model.safetensors").open("wb") as f:  # sparse: 300 MiB on paper, nothing on disk
        f.truncate(300 << 20)
    assert train_command(large) == f"{TRAIN_MODULE} --model {large} --device cuda --dtype float16"


# --- serving -----------------------------------------------------------------------------------


def test_a_foreign_estimator_is_refused_at_configuration(tmp_path, demo_paths):
    """What start-up runs (build_config): an estimator whose manifest's config hash is not the
    checkpoint's is refused as a config mismatch, with the command that trains the right one."""
    from sglang_kvx.config import KvxConfigError, build_config
    from sglang_kvx.models.demo import weights_root

    model = demo_paths["tiny-hybrid-deep"]
    foreign = tmp_path / "foreign"
    shutil.copytree(weights_root() / "gatesight" / "tiny-hybrid-deep", foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    (foreign / "manifest.json").write_text(json.dumps({**manifest, "config_hash": config_hash(weights_root() / "tiny-hybrid")}))
    with pytest.raises(KvxConfigError, match="config.json differs") as exc:
        build_config("gatesight", 0.5, model_path=model, estimator=str(foreign))
    assert f"train one with: {TRAIN_MODULE} --model {model}" in str(exc.value)


def test_serving_a_checkpoint_without_estimators_fails_at_start_up(launch_parser, demo_paths):
    """launch_server exits 2 before serving, naming the command that trains its estimators."""
    from sglang_kvx.models.demo import weights_root

    model = str(weights_root() / "tiny-hybrid")  # a hybrid nobody trained estimators for
    result = launch_parser.parse("--model-path", model, "--kvx-policy", "gatesight", "--kvx-keep-fraction", "0.2",
                                 "--max-total-tokens", "4096")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"sglang-kvx: error: no GateSight estimator was trained for {model}; train one with: "
            f"{TRAIN_MODULE} --model {model} (or pass --kvx-estimator DIR)") in result.stderr, result.stderr[-2000:]
