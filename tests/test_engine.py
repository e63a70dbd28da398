"""In-process serving through ``sglang.Engine`` (via ``sglang_kvx.engine.Engine``) against HF."""

from __future__ import annotations

import pytest

from sglang_kvx.config import KvxConfigError
from sglang_kvx.engine import Engine

pytestmark = pytest.mark.slow


def test_engine_generates_hf_greedy_tokens_on_the_hybrid(demo_paths, references):
    ref = references["tiny-hybrid-deep"]
    engine = Engine(model_path=demo_paths["tiny-hybrid-deep"], max_total_tokens=4096, kvx_policy="none")
    try:
        prompts = [ref.encode("The special magic number for forest is 31337. Remember it."), ref.encode("red blue green " * 30)]
        outputs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
        for prompt, out in zip(prompts, outputs):
            assert out["output_ids"] == ref.greedy(prompt, 10)
    finally:
        engine.shutdown()


def test_engine_refuses_a_bad_keep_fraction_before_starting(demo_paths):
    with pytest.raises(KvxConfigError, match=r"\(0, 1\]"):
        Engine(model_path=demo_paths["tiny-llama"], max_total_tokens=1024, kvx_keep_fraction=0)


def test_engine_refuses_what_its_page_size_breaks_before_starting(demo_paths):
    with pytest.raises(KvxConfigError, match="--page-size 16"):
        Engine(model_path=demo_paths["tiny-llama"], max_total_tokens=1024, kvx_policy="kvzip", kvx_keep_fraction=0.3,
               page_size=16)
