"""A second dense architecture (Qwen3: q/k norm before RoPE) serves on the CPU platform and matches HF."""

from __future__ import annotations

import pytest

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


def qwen3_spec(path: str):
    """A dense checkpoint no KVzap surrogate is trained for, with a policy and decode steps on: plain
    requests are served as plain SGLang serves them (this file), and test_kvzap_e2e asks it for KVzap."""
    return spec(path, "--context-length", "2048", "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5",
                "--kvx-decode-steps", "on", max_total_tokens=4096)


def test_tiny_qwen3_matches_hf(tiny_qwen3, server_pool):
    assert_serves_like_hf(server_pool.get(qwen3_spec(tiny_qwen3)), HFReference(tiny_qwen3))
