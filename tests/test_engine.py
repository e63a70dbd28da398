"""In-process serving through ``sglang.Engine`` (via ``sglang_kvx.engine.Engine``) against HF."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_kvx.config import KvxConfigError
from sglang_kvx.engine import Engine
from sglang_kvx.serve.launcher import server_env
from server_pool import FORKSERVER_START


ENGINE_SCRIPT = """
import json, sys
from sglang_kvx.engine import Engine

model, prompts = sys.argv[1], json.loads(sys.argv[2])
engine = Engine(model_path=model, max_total_tokens=4096, kvx_policy="none")
try:
    outputs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
    print("OUTPUT " + json.dumps([out["output_ids"] for out in outputs]), flush=True)
finally:
    engine.shutdown()
"""


@pytest.mark.slow
@pytest.mark.fresh_process
def test_engine_generates_hf_greedy_tokens_on_the_hybrid(demo_paths, references):
    """In a process of its own: SGLang's ``Engine.shutdown`` kills every child of the calling process
    (the suite's shared servers too) and leaves its own processes unreaped."""
    ref = references["tiny-hybrid-deep"]
    prompts = [ref.encode("The special magic number for forest is 31337. Remember it."), ref.encode("red blue green " * 30)]
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, demo_paths["tiny-hybrid-deep"], json.dumps(prompts)],
                          capture_output=True, text=True, timeout=600, env={**server_env(), **FORKSERVER_START})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("OUTPUT ")]
    for prompt, output in zip(prompts, json.loads(line.removeprefix("OUTPUT "))):
        assert output == ref.greedy(prompt, 10)


def test_engine_refuses_a_bad_keep_fraction_before_starting(demo_paths):
    with pytest.raises(KvxConfigError, match=r"\(0, 1\]"):
        Engine(model_path=demo_paths["tiny-llama"], max_total_tokens=1024, kvx_keep_fraction=0)


def test_engine_refuses_what_its_page_size_breaks_before_starting(demo_paths):
    with pytest.raises(KvxConfigError, match="--page-size 16"):
        Engine(model_path=demo_paths["tiny-llama"], max_total_tokens=1024, kvx_policy="kvzip", kvx_keep_fraction=0.3,
               page_size=16)
