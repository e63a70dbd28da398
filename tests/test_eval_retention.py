"""Needle retention: the value spans are the right tokens, and the counting is exact on hand-made keep-sets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from sglang_kvx.eval import generate_sample
from sglang_kvx.eval.retention import measure, needle_spans, retention
from sglang_kvx.select.keep_set import KeepSet


@pytest.fixture(scope="module")
def tokenizer(demo_paths):
    return AutoTokenizer.from_pretrained(demo_paths["tiny-hybrid-deep"])


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_3", "niah_multikey_1", "niah_multivalue"])
def test_value_spans_decode_to_the_queried_values(tokenizer, task: str) -> None:
    sample = generate_sample(task, 1024, seed=3, index=1, tokenizer=tokenizer)
    ids = tokenizer(sample.context).input_ids
    spans = needle_spans(sample, tokenizer)
    assert len(spans) == len(sample.answers)  # one queried needle per expected answer here
    for (start, end), answer in zip(spans, sorted(sample.answers, key=lambda a: sample.context.index(a))):
        decoded = tokenizer.decode(ids[start:end]).strip()
        assert answer in decoded and len(decoded) <= len(answer) + 2  # the value, not its sentence


def test_retention_counts_each_layer_and_head() -> None:
    n = 20
    # layer 0: head 0 keeps all of span [4, 8), head 1 half of it; layer 1: neither head keeps any
    keep = KeepSet(positions=[torch.tensor([[4, 5, 6, 7], [4, 5, 12, 13]]), torch.tensor([[0, 1, 2, 3], [16, 17, 18, 19]])],
                   n=n, protected_prefix_len=0)
    kept, whole, per_layer = retention(keep, [(4, 8)])
    assert kept == pytest.approx((1.0 + 0.5 + 0 + 0) / 4)
    assert whole == pytest.approx(1 / 4)
    assert per_layer == pytest.approx([0.75, 0.0])
    with pytest.raises(ValueError, match="no queried needle"):
        retention(keep, [])


def test_keeping_everything_retains_every_value(demo_paths) -> None:
    rows = measure(demo_paths["tiny-hybrid-deep"], ["niah_single_2"], 256, 1, ["keydiff", "streamingllm"], [1.0, 0.1])
    full = [r for r in rows if r["keep_fraction"] == 1.0]
    assert full and all(r["value_entries_kept"] == 1.0 and r["whole_value_kept"] == 1.0 for r in full)
    recent_only = [r for r in rows if r["keep_fraction"] == 0.1 and r["policy"] == "streamingllm"][0]
    assert recent_only["value_entries_kept"] < 1.0  # a 256-token context keeps 25 entries: sinks + the tail
