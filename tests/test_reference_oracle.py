"""The HF compaction oracle: keeping everything is the plain model; dropping entries changes the answer."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid-deep"])
def test_keep_all_equals_plain_greedy(references, name):
    ref = references[name]
    context = ref.encode("red blue green river mountain forest " * 20)
    question = ref.encode(" what is the number?")
    n, kv_heads = len(context), ref.model.config.num_key_value_heads
    keep_all = [torch.arange(n).expand(kv_heads, n) for _ in ref.attention_layer_ids]
    assert ref.compacted_greedy(context, keep_all, question, 10) == ref.greedy(context + question, 10)


def test_dropping_entries_changes_the_answer(references):
    ref = references["tiny-llama"]
    context = ref.encode("red blue green river mountain forest " * 20)
    question = ref.encode(" what is the number?")
    n, kv_heads = len(context), ref.model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(0)
    keep_few = [torch.stack([torch.randperm(n, generator=gen)[: n // 10].sort().values for _ in range(kv_heads)])
                for _ in ref.attention_layer_ids]
    assert ref.compacted_greedy(context, keep_few, question, 10) != ref.greedy(context + question, 10)


def test_keep_set_with_wrong_layer_count_is_refused(references):
    ref = references["tiny-hybrid-deep"]
    with pytest.raises(ValueError, match="attention layers"):
        ref.compacted_greedy([1, 2, 3], [], [4], 1)
