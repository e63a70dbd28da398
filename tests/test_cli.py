"""Bad flags on SGLang's own launcher: one clear line naming the valid choices, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_kvx.serve.launcher import server_env


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        capture_output=True, text=True, timeout=300, env=server_env(),
    )


def our_error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("sglang-kvx: error:")]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (("--kvx-policy", "bogus"), "unknown --kvx-policy 'bogus'; valid choices: gatesight, h2o, keydiff, knorm, kvzip, none, pyramidkv, random, snapkv, streamingllm, triattention"),
        (("--kvx-keep-fraction", "0"), "--kvx-keep-fraction must be in (0, 1], got 0"),
        (("--kvx-keep-fraction", "1.5"), "--kvx-keep-fraction must be in (0, 1], got 1.5"),
        (("--kvx-keep-fraction", "half"), "--kvx-keep-fraction must be a number in (0, 1], got 'half'"),
        (("--kvx-policy", "gatesight"), "--kvx-policy gatesight needs gdn, output_gate, which LlamaForCausalLM does not provide"),
    ],
)
def test_bad_flags_fail_fast_with_one_line(demo_paths, flags, expected):
    result = launch("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [f"sglang-kvx: error: {expected}"]
    assert "Load weight" not in result.stdout + result.stderr  # refused before the model loads


def test_missing_model_path_is_a_clear_error():
    result = launch("--model-path", "/nonexistent/model", "--max-total-tokens", "1024")
    assert result.returncode == 2
    assert our_error_lines(result.stderr) == ["sglang-kvx: error: --model-path /nonexistent/model does not exist"]


def test_launcher_help_lists_the_kvx_flags():
    result = launch("--help")
    assert result.returncode == 0
    assert "--kvx-policy" in result.stdout and "--kvx-keep-fraction" in result.stdout
