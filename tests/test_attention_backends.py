"""Per-layer budgets (PyramidKV, GateSight's gate allocation) on SGLang's own attention backends.

The plugin gives every full-attention backend SGLang builds the per-layer-lengths mixin
(``adapter/attention.py``). Here the server runs SGLang's ``torch_native`` backend, not ours,
with GateSight's signals recomputed around the GDN layers as on GPU, and its children must
still equal the HF oracle applying the served keep-set.
"""

from __future__ import annotations

import pytest
import requests
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_kvx.adapter.attention import (
    KvxTorchNativeAttnBackend,
    PerLayerLengths,
    has_per_layer_lengths,
    per_layer_lengths_class,
    with_per_layer_lengths,
)

from test_compaction_e2e import GREEDY, compact, kvx, text


class _Backend:
    def __init__(self) -> None:
        self.token_to_kv_pool = "pool"


class _Hybrid:
    def __init__(self, full) -> None:
        self.full_attn_backend = full
        self.linear_attn_backend = object()


class _Split:
    def __init__(self, prefill, decode) -> None:
        self.prefill_backend, self.decode_backend = prefill, decode


def test_the_mixin_keeps_the_backend_and_its_class() -> None:
    backend = _Backend()
    assert not has_per_layer_lengths(backend) and not has_per_layer_lengths(_Hybrid(backend))
    wrapped = with_per_layer_lengths(backend)
    assert wrapped is backend and isinstance(backend, _Backend) and isinstance(backend, PerLayerLengths)
    assert type(backend).forward_extend is not _Backend.__dict__.get("forward_extend")
    assert backend.token_to_kv_pool == "pool"
    assert per_layer_lengths_class(_Backend) is type(backend)  # one subclass per class
    assert per_layer_lengths_class(type(backend)) is type(backend)  # wrapping twice changes nothing
    assert has_per_layer_lengths(_Hybrid(backend))
    # A prefill/decode split needs both sides.
    assert not has_per_layer_lengths(_Hybrid(_Split(backend, _Backend())))
    assert has_per_layer_lengths(_Hybrid(_Split(backend, with_per_layer_lengths(_Backend()))))
    assert issubclass(KvxTorchNativeAttnBackend, TorchNativeAttnBackend) and has_per_layer_lengths(
        KvxTorchNativeAttnBackend.__new__(KvxTorchNativeAttnBackend))


class _Planned:
    """A backend whose out-of-graph preparation records how SGLang called it."""

    def __init__(self) -> None:
        self.calls = []

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False, extra=None):
        self.calls.append((forward_batch, in_capture, extra))


def test_the_out_of_graph_preparation_passes_sglangs_arguments_through() -> None:
    """SGLang's runners call a backend's replay preparation with ``in_capture`` by name or position (and some
    backends take more): the subclass hands every argument to the base as given."""
    backend = with_per_layer_lengths(_Planned())
    backend.init_forward_metadata_out_graph("fb")
    backend.init_forward_metadata_out_graph("fb", True)
    backend.init_forward_metadata_out_graph("fb", in_capture=True, extra=7)
    assert backend.calls == [("fb", False, None), ("fb", True, None), ("fb", True, 7)]


@pytest.mark.parametrize("gqa", (1, 3))
def test_our_extend_equals_sglangs_whole_row_extend_on_new_queries_only(gqa: int) -> None:
    """Rows with no prefix, a cached prefix and one new token, more new tokens than a query block
    (under half the row: our path), and new tokens over half the row (SGLang's causal pass, on
    that row alone), in one batch over a shuffled paged pool: the same outputs as SGLang's
    torch-native extend (which attends from every position of each row), for torch_native as
    the plugin switches it and for ours."""
    g = torch.Generator().manual_seed(gqa)
    hq, dim = 6, 16
    pool, slots_per_row = 8192, 2048
    k_cache, v_cache = (torch.randn(pool, hq // gqa, dim, generator=g) for _ in range(2))
    req_to_token = torch.randperm(pool, generator=g)[: 4 * slots_per_row].view(4, slots_per_row).to(torch.int32)
    prefix, extend = torch.tensor([0, 700, 900, 129]), torch.tensor([37, 1, 600, 890])
    rows = torch.tensor([2, 0, 3, 1])
    query = torch.randn(int(extend.sum()), hq, dim, generator=g)
    args = (k_cache, v_cache, req_to_token, rows, prefix + extend, prefix, extend)
    options = {"scaling": 0.3, "enable_gqa": gqa > 1, "causal": True}
    want = TorchNativeAttnBackend._run_sdpa_forward_extend(
        object.__new__(TorchNativeAttnBackend), query, torch.empty_like(query), *args, **options)
    backend = with_per_layer_lengths(object.__new__(TorchNativeAttnBackend))
    assert type(backend) is KvxTorchNativeAttnBackend
    backend.EXTEND_QUERY_BLOCK = 256  # three blocks in the third row
    got = backend._run_sdpa_forward_extend(query, torch.empty_like(query), *args, **options)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.slow
def test_sglang_torch_native_backend_serves_per_layer_budgets(recomputing_hybrid) -> None:
    server, ref = recomputing_hybrid
    context = ref.encode(text(260, seed=31))
    questions = [ref.encode("Question: which word comes next? Answer:"), ref.encode("Question: and the word after? Answer:")]
    # GateSight's gate budgets, PyramidKV's, and KVzip's scores under PyramidKV budgets (folded after its
    # second pass). PyramidKV's reference budgets fall back to flat ones unless the last layer keeps at
    # least the 64-token window, so its cases keep half the context.
    for policy, allocation, fraction in (("gatesight", "gate", 0.2), ("pyramidkv", None, 0.5), ("kvzip", "pyramidkv", 0.5)):
        compact(server, context, policy, fraction, allocation=allocation)
        entries = requests.get(server.url + "/kvx/keep_sets", timeout=30).json()
        (entry,) = [e for e in entries if e["policy"] == policy]
        keep = [torch.tensor(layer) for layer in entry["positions"]]
        kept = [k.shape[1] for k in keep]
        assert len(set(kept)) > 1, kept  # the layers keep different numbers: the masked path runs
        for question in questions:
            response = server.generate({"input_ids": context + question, "return_logprob": True, "sampling_params": {
                **GREEDY, "max_new_tokens": 8, **kvx(policy, fraction, allocation=allocation)}})
            assert response.status_code == 200, response.text
            body = response.json()
            expected_ids, expected_lp = ref.compacted_generate(context, keep, question, 8)
            assert body["output_ids"] == expected_ids, policy
            served_lp = [e[0] for e in body["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(served_lp, expected_lp)) <= 1e-4
            # The layers are folded: the context holds the mean of the per-layer counts, not the largest.
            slots = body["meta_info"]["kvx"][-1]["slots"]
            assert slots == entry["slots"] == -(-sum(kept) // len(kept)) < max(kept)
            assert body["meta_info"]["cached_tokens"] == len(context)  # SGLang's count: the tokens not prefilled
    stats = server.stats()
    assert sorted(c["reuse_count"] for c in stats["compacted_contexts"]) == [2, 2, 2]
