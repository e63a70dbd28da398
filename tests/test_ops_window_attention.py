"""Decode attention over sinks + a recent window of the paged KV (ops/window_attention.py).

The torch reference is checked against an independent dense computation (every key of the row,
a plain masked softmax per head) and against the prefix-cells op with the hidden interval
[sinks, seq_len - window); the Triton kernel against the reference under TRITON_INTERPRET=1.
FlashInfer itself needs CUDA: on CPU only the FlashInfer path's plumbing (index sets, the sinks
merge) runs, against a stand-in module whose calls are bound to the installed FlashInfer's
signatures.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from sglang_kvx.ops.flashinfer_plans import DecodePlans
from sglang_kvx.ops.flashinfer_window_attention import window_attention_flashinfer
from sglang_kvx.ops.prefix_attention import prefix_cells_attention_reference
from sglang_kvx.ops.window_attention import window_attention, window_attention_reference

from interpreter import interpreted_lines


def random_case(seed: int, dtype: torch.dtype = torch.float32, kv_heads: int = 2, heads: int = 4,
                v_dim: int = 16) -> dict:
    """Seven rows over a shared pool: Local with sinks, Local without sinks, Full (window 0), a
    window longer than the row, sinks reaching into the window, a one-key row, a negative window."""
    g = torch.Generator().manual_seed(seed)
    pool, dim = 700, 24
    req_to_token = torch.randperm(pool, generator=g)[: 8 * 85].reshape(8, 85).to(torch.int32)
    return dict(
        q=torch.randn(7, heads, dim, generator=g).to(dtype),
        k_cache=torch.randn(pool, kv_heads, dim, generator=g).to(dtype),
        v_cache=torch.randn(pool, kv_heads, v_dim, generator=g).to(dtype),
        req_to_token=req_to_token,
        rows=torch.tensor([4, 0, 2, 7, 1, 5, 3]),
        seq_lens=torch.tensor([60, 85, 40, 12, 30, 1, 50]),
        sinks=torch.tensor([4, 0, 3, 2, 25, 4, 2]),
        window=torch.tensor([16, 20, 0, 12, 10, 8, -1]),
        scaling=0.2, k_scale=1.5, v_scale=0.5,
    )


def by_hand(case: dict) -> torch.Tensor:
    """Per row and head: all the row's keys, those outside sinks + window masked, plain softmax."""
    num_heads = case["q"].shape[1]
    group = num_heads // case["k_cache"].shape[1]
    out = torch.empty(case["q"].shape[0], num_heads, case["v_cache"].shape[-1])
    for b in range(case["q"].shape[0]):
        row, seq_len = int(case["rows"][b]), int(case["seq_lens"][b])
        sinks, window = int(case["sinks"][b]), int(case["window"][b])
        full = window <= 0 or window >= seq_len
        seen = torch.tensor([full or j < sinks or j >= seq_len - window for j in range(seq_len)])
        slots = case["req_to_token"][row, :seq_len].long()
        for h in range(num_heads):
            keys = case["k_cache"][slots, h // group].double() * case["k_scale"]
            values = case["v_cache"][slots, h // group].double() * case["v_scale"]
            logits = (keys @ case["q"][b, h].double()) * case["scaling"]
            weights = torch.exp(logits - logits[seen].max()) * seen
            out[b, h] = (weights / weights.sum() @ values).float()
    return out


@pytest.mark.parametrize("kv_heads,heads", [(2, 4), (1, 3), (4, 4)])
def test_reference_sees_exactly_sinks_and_window(kv_heads, heads) -> None:
    case = random_case(0, kv_heads=kv_heads, heads=heads)
    got = window_attention_reference(**case)
    assert got.shape == (7, heads, 16) and got.dtype == torch.float32
    assert torch.allclose(got, by_hand(case), atol=1e-5)
    # Reading every key is plain Full attention, which differs on the Local rows: the check can fail.
    full = {**case, "window": torch.zeros(7, dtype=torch.long)}
    assert torch.allclose(window_attention_reference(**full), by_hand(full), atol=1e-5)
    local = torch.tensor([True, True, False, False, False, False, False])
    differs = (window_attention_reference(**full) - got).abs().amax(dim=(1, 2)) > 1e-3
    assert torch.equal(differs, local)  # rows 2-6 read their whole row either way


def test_prefix_op_with_the_hidden_interval_is_the_window_op() -> None:
    """The prefix-cells op hiding [sinks, seq_len - window) (nothing for Full rows) is the same attention."""
    case = random_case(1)
    full = (case["window"] <= 0) | (case["window"] >= case["seq_lens"])
    hidden_from = torch.where(full, 0, case["sinks"])
    hidden_to = torch.where(full, 0, case["seq_lens"] - case["window"])
    prefix = prefix_cells_attention_reference(
        case["q"], case["k_cache"], case["v_cache"], case["req_to_token"], case["rows"], case["seq_lens"],
        torch.ones(7, dtype=torch.long), hidden_from, hidden_to,
        case["k_cache"][:0], case["v_cache"][:0], torch.zeros(8, dtype=torch.long),
        case["scaling"], case["k_scale"], case["v_scale"])
    assert torch.allclose(window_attention(**case), prefix, atol=1e-5)


def test_cpu_dispatch_is_the_reference_and_keeps_the_dtype() -> None:
    case = random_case(2, torch.bfloat16)
    got = window_attention(**case)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, window_attention_reference(**case))
    strided_q = case["q"].transpose(0, 1).contiguous().transpose(0, 1)  # heads-major memory
    assert torch.equal(window_attention(**{**case, "q": strided_q}), got)
    empty = {**case, "q": case["q"][:0], **{k: case[k][:0] for k in ("rows", "seq_lens", "sinks", "window")}}
    assert window_attention(**empty).shape == (0, 4, 16)


def test_triton_kernel_matches_the_reference_under_the_interpreter() -> None:
    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_ops_window_attention import random_case\n"
        "from sglang_kvx.ops.window_attention import window_attention\n"
        "from sglang_kvx.ops.triton_window_attention import window_attention_triton\n"
        "for seed, dtype, kv, h in [(3, torch.float32, 2, 4), (4, torch.float32, 1, 3), (5, torch.bfloat16, 2, 4)]:\n"
        "    case = random_case(seed, dtype, kv, h)\n"
        "    want = window_attention(**case, impl='torch').float()\n"
        "    got = window_attention(**case, impl='triton').float()\n"
        "    small_tiles = window_attention_triton(**case, block_n=4).float()\n"
        "    print(dtype, float((got - want).abs().max()), float((small_tiles - want).abs().max()))\n"
    )
    lines = interpreted_lines(code)
    assert len(lines) == 3, lines
    for line in lines:
        dtype, err, err_small = line.split()
        limit = 1e-4 if dtype == "torch.float32" else 1e-2  # bf16 outputs round at ~4e-3
        assert float(err) < limit and float(err_small) < limit, line


def test_bad_inputs_and_cpu_kernels_are_refused(monkeypatch) -> None:
    case = random_case(0)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        window_attention(**{**case, "q": case["q"][:, :3]})
    with pytest.raises(ValueError, match="one entry per query row"):
        window_attention(**{**case, "sinks": case["sinks"][:3]})
    with pytest.raises(ValueError, match="seq_len >= 1"):
        window_attention(**{**case, "seq_lens": case["seq_lens"] * 0})
    with pytest.raises(ValueError, match="impl"):
        window_attention(**case, impl="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        window_attention(**case, impl="triton")
    with pytest.raises(RuntimeError, match="FlashInfer"):
        window_attention(**case, impl="flashinfer")


class _StandInDecodeWrapper:
    """Plain-torch stand-in for flashinfer.BatchDecodeWithPagedKVCacheWrapper (page size 1, NHD)."""

    real = None  # the installed class, when flashinfer imports: every call is bound to its signature

    def __init__(self, *args, **kwargs) -> None:
        self._bind("__init__", args, kwargs)

    def _bind(self, name: str, args: tuple, kwargs: dict) -> None:
        if self.real is not None:
            target = getattr(self.real, "_plan_impl" if name == "plan" else name)
            inspect.signature(target).bind(self, *args, **kwargs)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs) -> None:
        self._bind("plan", (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size), kwargs)
        assert page_size == 1 and bool((last_page_len == 1).all()) and indptr.dtype == indices.dtype == torch.int32
        self.indptr, self.indices, self.sm_scale = indptr.long(), indices.long(), kwargs["sm_scale"]

    def run(self, q, paged_kv_cache, **kwargs):
        self._bind("run", (q, paged_kv_cache), kwargs)
        k_pages, v_pages = paged_kv_cache
        group = q.shape[1] // k_pages.shape[2]
        out, lse = kwargs["out"], kwargs["lse"]
        for b in range(q.shape[0]):
            slots = self.indices[self.indptr[b] : self.indptr[b + 1]]
            keys = k_pages[slots, 0].float().repeat_interleave(group, 1)  # [n, Hq, D]
            values = v_pages[slots, 0].float().repeat_interleave(group, 1)
            logits = torch.einsum("hd,nhd->hn", q[b].float(), keys) * self.sm_scale * kwargs["k_scale"]
            lse[b] = logits.logsumexp(-1)
            out[b] = (torch.einsum("hn,nhe->he", logits.softmax(-1), values) * kwargs["v_scale"]).to(out.dtype)
        return out, lse


def _stand_in_merge_state(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    v = torch.exp(s_a - s)[..., None] * v_a.float() + torch.exp(s_b - s)[..., None] * v_b.float()
    return v.to(v_a.dtype), s


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing flashinfer's CuTe kernels
def test_flashinfer_path_plumbing_with_a_stand_in(monkeypatch) -> None:
    """Window and sinks as two index sets, merged for the rows with sinks: equals the reference."""
    try:
        import flashinfer

        _StandInDecodeWrapper.real = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        inspect.signature(flashinfer.merge_state).bind(*range(4))
    except ImportError:
        _StandInDecodeWrapper.real = None
    stand_in = type(sys)("flashinfer")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = _StandInDecodeWrapper
    stand_in.merge_state = _stand_in_merge_state
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    for kv_heads, heads in [(2, 4), (1, 8)]:  # plain and tensor-core wrappers (group 8 > 4)
        case = random_case(6, kv_heads=kv_heads, heads=heads, v_dim=24)  # FlashInfer needs D == Dv
        got = window_attention_flashinfer(**case, plans=DecodePlans(workspace_bytes=16))
        assert torch.allclose(got, window_attention_reference(**case), atol=1e-5)


def test_flashinfer_plans_once_per_batch_and_key(monkeypatch) -> None:
    """Plan once, run many: the layers of one forward batch that hide the same ranges (one key) share
    the window plan and the sinks plan; another key or the next batch plans anew; no key plans each call."""
    _StandInDecodeWrapper.real = None
    stand_in = type(sys)("flashinfer")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = _StandInDecodeWrapper
    stand_in.merge_state = _stand_in_merge_state
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    plans = DecodePlans(workspace_bytes=16)
    case = random_case(6, v_dim=24)  # FlashInfer needs D == Dv
    other = {**case, "window": case["window"] + 1}  # another layer hiding other ranges
    want, want_other = window_attention_reference(**case), window_attention_reference(**other)
    for layer in range(4):  # four layers of one batch: two plans (window, sinks) made by the first
        assert torch.allclose(window_attention_flashinfer(**case, plans=plans, plan_key="hidden-a"), want, atol=1e-5)
    assert plans.plan_count == 2
    assert torch.allclose(window_attention_flashinfer(**other, plans=plans, plan_key="hidden-b"), want_other, atol=1e-5)
    assert plans.plan_count == 4
    plans.begin_batch()  # the next forward batch: its cells are new
    assert torch.allclose(window_attention_flashinfer(**other, plans=plans, plan_key="hidden-a"), want_other, atol=1e-5)
    assert plans.plan_count == 6
    window_attention_flashinfer(**case, plans=plans)
    window_attention_flashinfer(**case, plans=plans)
    assert plans.plan_count == 10
