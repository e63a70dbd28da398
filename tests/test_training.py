"""The demo-model training pipeline: data generator, a few optimiser steps, checkpoint round trip."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from sglang_kvx.training.train_demo import (
    TASKS,
    NeedleDataGenerator,
    TrainConfig,
    build_initial_model,
    collate,
    compute_loss,
    is_exact_match,
    make_optimizer,
    measure_gdn_half_lives,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def initial() -> tuple[torch.nn.Module, object]:
    """The untrained tiny hybrid (built in a temporary folder, not weights/)."""
    return build_initial_model(seed=0)


@pytest.mark.parametrize("task", TASKS)
def test_generator_is_deterministic_per_seed(initial, task: str) -> None:
    _, tokenizer = initial
    first = NeedleDataGenerator(tokenizer, seed=7).sample(task, 256)
    again = NeedleDataGenerator(tokenizer, seed=7).sample(task, 256)
    other = NeedleDataGenerator(tokenizer, seed=8).sample(task, 256)
    assert first.input_ids == again.input_ids and first.values == again.values
    assert first.input_ids != other.input_ids


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [128, 512])
def test_needle_answer_is_in_the_context(initial, task: str, length: int) -> None:
    _, tokenizer = initial
    gen = NeedleDataGenerator(tokenizer, seed=3)
    for _ in range(5):
        sample = gen.needle_sample(task, length)
        # Filler is cut at word boundaries, so a sample falls a few tokens short at most.
        assert length - 8 <= len(sample.input_ids) <= length
        assert sample.input_ids[0] == tokenizer.bos_token_id
        prompt = tokenizer.decode(sample.prompt_ids)
        answer = tokenizer.decode(sample.input_ids[sample.answer_start :])
        assert is_exact_match(answer, sample.values)
        context, question = prompt.rsplit("\n", 1)
        key = question.split(" for ", 1)[1].split("?", 1)[0]
        for value in sample.values:
            assert f"for {key} is {value}." in context
        if task == "multikey":
            # Distractor needles carry other keys in the same wording.
            assert context.count("The special magic number for ") >= 2
            assert context.count(f"for {key} is ") == 1


def test_copy_sample_repeats_its_segment(initial) -> None:
    _, tokenizer = initial
    sample = NeedleDataGenerator(tokenizer, seed=1).copy_sample(128)
    repeat = sample.input_ids[sample.answer_start :]
    first = sample.input_ids[1 : 1 + len(repeat)]
    assert repeat == first and len(repeat) > 40


def test_a_few_steps_lower_the_loss(initial) -> None:
    model, tokenizer = initial
    model = copy.deepcopy(model)
    model.train()
    gen = NeedleDataGenerator(tokenizer, seed=0)
    batch = collate([gen.needle_sample(task, 128) for task in ("single", "multikey", "multivalue", "single")], tokenizer.pad_token_id)
    cfg = TrainConfig()
    optimizer = make_optimizer(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        before = compute_loss(model, batch, cfg.lm_weight)[0].item()
    for _ in range(8):
        loss, _, _ = compute_loss(model, batch, cfg.lm_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
    with torch.no_grad():
        after = compute_loss(model, batch, cfg.lm_weight)[0].item()
    assert after < before - 0.1, (before, after)


def test_checkpoint_round_trips_in_hf(initial, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = initial
    model.eval()
    meta = {"name": "tiny-hybrid", "seed": 0, "trained": True}
    save_checkpoint(model, tokenizer, tmp_path, meta)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["full_attention_interval"] == 4
    assert json.loads((tmp_path / "kvx_demo.json").read_text())["trained"] is True
    assert (tmp_path / "model.safetensors").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    sample = NeedleDataGenerator(tokenizer, seed=2).needle_sample("multikey", 256)
    assert reloaded_tokenizer.decode(sample.input_ids) == tokenizer.decode(sample.input_ids)
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_half_lives_cover_every_gdn_head(initial) -> None:
    model, tokenizer = initial
    sample = NeedleDataGenerator(tokenizer, seed=4).needle_sample("single", 256)
    half_lives = measure_gdn_half_lives(model, sample.input_ids)
    assert sorted(half_lives) == ["0", "1", "2"]  # the three GDN layers; layer 3 is full attention
    assert all(len(h) == 4 and all(x > 0 for x in h) for h in half_lives.values())


def test_exact_match_needs_every_value_in_order() -> None:
    assert is_exact_match(" 12345.", ("12345",))
    assert not is_exact_match(" 123456", ("12345",))
    assert is_exact_match(" 11111 and 22222.", ("11111", "22222"))
    assert not is_exact_match(" 22222 and 11111.", ("11111", "22222"))


def test_dense_architecture_trains_and_saves_as_llama(tmp_path) -> None:
    """The dense demo model (dense-only comparisons) goes through the same recipe: a few steps lower
    its loss, it has no GDN half-lives, and its checkpoint stays a plain Llama config."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = build_initial_model(seed=0, arch="tiny-llama")
    assert model.config.model_type == "llama"
    gen = NeedleDataGenerator(tokenizer, seed=0)
    batch = collate([gen.needle_sample(task, 128) for task in ("single", "multikey")], tokenizer.pad_token_id)
    cfg = TrainConfig()
    optimizer = make_optimizer(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        before = compute_loss(model, batch, cfg.lm_weight)[0].item()
    model.train()
    for _ in range(8):
        loss, _, _ = compute_loss(model, batch, cfg.lm_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        assert compute_loss(model, batch, cfg.lm_weight)[0].item() < before - 0.1
    assert measure_gdn_half_lives(model, batch.input_ids[0].tolist()) == {}
    save_checkpoint(model, tokenizer, tmp_path, {"name": "tiny-llama", "trained": True})
    assert "full_attention_interval" not in json.loads((tmp_path / "config.json").read_text())
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.model_type == "llama"


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown architecture"):
        build_initial_model(seed=0, arch="tiny-mamba")


def test_finetune_learning_rate_schedules() -> None:
    from sglang_kvx.training.finetune_ruler import learning_rate

    assert learning_rate(1e-3, "constant", 0, 20, 0.0) == pytest.approx(5e-5)  # warm-up
    assert learning_rate(1e-3, "constant", 500, 20, 0.9) == pytest.approx(1e-3)
    assert learning_rate(1e-3, "cosine", 500, 20, 0.0) == pytest.approx(1e-3)
    assert learning_rate(1e-3, "cosine", 500, 20, 0.5) == pytest.approx(5.5e-4)
    assert learning_rate(1e-3, "cosine", 500, 20, 1.0) == pytest.approx(1e-4)  # a tenth at the end
    assert learning_rate(1e-3, "cosine", 500, 20, 1.3) == pytest.approx(1e-4)  # the last step may overrun
    with pytest.raises(ValueError, match="linear"):
        learning_rate(1e-3, "linear", 0, 20, 0.0)
