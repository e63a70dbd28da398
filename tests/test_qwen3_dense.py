"""A second dense architecture (Qwen3: q/k norm before RoPE) serves on the CPU platform and matches HF."""

from __future__ import annotations

import pytest

from sglang_kvx.models.demo import build_demo_model
from sglang_kvx.reference.hf import HFReference
from sglang_kvx.serve.launcher import ServerProcess

from server_pool import spec

pytestmark = pytest.mark.slow


def assert_serves_like_hf(server: ServerProcess, ref: HFReference) -> None:
    """Greedy tokens equal HF's and prompt log-probabilities agree within 1e-4."""
    prompt = ref.encode("red blue green river " * 40)
    body = server.generate(
        {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
         "return_logprob": True, "logprob_start_len": 0}
    ).json()
    assert body["output_ids"] == ref.greedy(prompt, 12)
    served = [e[0] for e in body["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(served, ref.prompt_logprobs(prompt))) <= 1e-4


def test_tiny_qwen3_matches_hf(tmp_path, server_pool):
    path = build_demo_model("tiny-qwen3", tmp_path / "tiny-qwen3")
    assert_serves_like_hf(server_pool.get(spec(path, max_total_tokens=4096)), HFReference(path))
