"""The gated softmax/sigmoid paged attention op (``ops/gated_attention.py``).

The torch reference against an independent one: the HF model's dense ``gated_attention``
(``models/gated.py``) on each row's keys gathered from the pool, with the eviction rule written as
a keep mask (prefill queries read all; a decode query reads keys with g >= tau and its own key).
The Triton kernel against the reference under TRITON_INTERPRET=1.
"""

from __future__ import annotations


import pytest
import torch

from sglang_kvx.models.gated import gated_attention as dense_gated_attention
from sglang_kvx.ops.gated_attention import FoldedKeys, gated_attention, gated_attention_reference

from interpreter import interpreted_lines


def random_case(seed: int, kind: str = "sigmoid", gated: bool = True, kv_heads: int = 2, heads: int = 4,
                decode: bool = False, tau: float = 0.3, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pool, dim = 96, 8
    seq_lens = torch.tensor([13, 1, 30, 22])
    q_lens = torch.ones(4, dtype=torch.long) if decode else torch.tensor([5, 1, 30, 7])
    rows = torch.tensor([2, 0, 3, 1])
    req_to_token = torch.zeros((4, 40), dtype=torch.int32)
    perm = torch.randperm(pool - 1, generator=gen) + 1  # slot 0 unused, as SGLang keeps it
    at = 0
    for row, length in zip(rows.tolist(), seq_lens.tolist()):
        req_to_token[row, :length] = perm[at : at + length].to(torch.int32)
        at += length
    positions = torch.cat([torch.arange(int(s) - int(n), int(s)) for s, n in zip(seq_lens, q_lens)])
    gate = torch.rand(pool, generator=gen).to(dtype) if gated else None
    return dict(
        q=torch.randn(int(q_lens.sum()), heads, dim, generator=gen).to(dtype),
        k_cache=torch.randn(pool, kv_heads, dim, generator=gen).to(dtype),
        v_cache=torch.randn(pool, kv_heads, dim, generator=gen).to(dtype),
        key_gate=gate, req_to_token=req_to_token, rows=rows, seq_lens=seq_lens, q_lens=q_lens,
        q_positions=positions, tau=torch.tensor([tau, 0.0, tau, tau]) if decode else torch.zeros(4),
        kind=kind, scaling=dim ** -0.5,
    )


def independent(case: dict) -> torch.Tensor:
    """Row by row through the HF model's attention (float32), the rule as a keep mask."""
    outs, start = [], 0
    heads, kv_heads = case["q"].shape[1], case["k_cache"].shape[1]
    for b in range(case["rows"].numel()):
        n, length = int(case["q_lens"][b]), int(case["seq_lens"][b])
        slots = case["req_to_token"][case["rows"][b], :length].long()
        k = case["k_cache"][slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        v = case["v_cache"][slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        q = case["q"][start : start + n].float().transpose(0, 1)[None]  # the model scales by 1/sqrt(d) = scaling
        q_pos = case["q_positions"][start : start + n][None]
        k_pos = torch.arange(length)[None]
        gate = case["key_gate"][slots].float()[None] if case["key_gate"] is not None else None
        keep = None
        if gate is not None and float(case["tau"][b]) > 0:
            keep = (gate[:, None, :] >= float(case["tau"][b])) | (k_pos[:, None, :] == q_pos[:, :, None])
        out, _ = dense_gated_attention(q, k, v, q_pos, k_pos, case["kind"], key_gate=gate, keep=keep)
        outs.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["sigmoid", "softmax"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("decode", [False, True])
def test_reference_matches_the_models_attention_with_the_eviction_rule(kind, gated, decode) -> None:
    case = random_case(1, kind, gated, decode=decode)
    got = gated_attention_reference(**case)
    assert torch.allclose(got, independent(case), atol=1e-5), float((got - independent(case)).abs().max())


@pytest.mark.parametrize("kind", ["sigmoid", "softmax"])
def test_per_head_keep_masks_and_weight_sums_match_the_models_attention(kind) -> None:
    """Per-head eviction (online H2O, KeyDiff): each KV head reads its own keys; the weights its
    query group paid each key come back summed, as the model's own attention weights give them."""
    case = random_case(5, kind, gated=False, decode=False)
    heads, kv_heads = case["q"].shape[1], case["k_cache"].shape[1]
    gen = torch.Generator().manual_seed(6)
    keep = {b: torch.rand((kv_heads, int(case["seq_lens"][b])), generator=gen) > 0.4 for b in (0, 2)}
    sums = {0: None, 2: None, 3: None}
    got = gated_attention_reference(**case, key_keep=keep, weight_sums=sums)
    start = 0
    for b in range(4):
        n, length = int(case["q_lens"][b]), int(case["seq_lens"][b])
        slots = case["req_to_token"][case["rows"][b], :length].long()
        k = case["k_cache"][slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        v = case["v_cache"][slots].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)[None]
        q = case["q"][start : start + n].float().transpose(0, 1)[None]
        mask = None
        if b in keep:
            mask = keep[b].repeat_interleave(heads // kv_heads, 0)[None, :, None, :].expand(1, heads, n, length)
        out, a = dense_gated_attention(q, k, v, case["q_positions"][start : start + n][None], torch.arange(length)[None],
                                       kind, keep=mask)
        assert torch.allclose(got[start : start + n], out[0].transpose(0, 1), atol=1e-5)
        if b in sums:
            want = a[0].sum(1).view(kv_heads, heads // kv_heads, length).sum(1)
            assert torch.allclose(sums[b], want, atol=1e-5)
        start += n
    assert set(sums) == {0, 2, 3} and all(s is not None for s in sums.values())  # only the rows asked for
    assert not torch.allclose(got, gated_attention_reference(**case))  # the masks bite


def test_tau_deletes_only_decode_keys_below_it_and_never_the_query_itself() -> None:
    case = random_case(2, "sigmoid", True, decode=True, tau=0.5)
    kept = gated_attention_reference(**case)
    assert not torch.allclose(kept, gated_attention_reference(**{**case, "tau": torch.zeros(4)}))
    # Deleting a key is the same as that key never having been cached (its row cell points at a zero-gate slot).
    row, b = int(case["rows"][0]), 0
    slots = case["req_to_token"][row, : int(case["seq_lens"][b])].long()
    below = slots[:-1][case["key_gate"][slots[:-1]] < 0.5]
    zeroed = case["key_gate"].clone()
    zeroed[below] = 0.0  # log(0 + 1e-8) and v * 0: no contribution (sigmoid of a very negative logit)
    again = gated_attention_reference(**{**case, "key_gate": zeroed, "tau": torch.zeros(4)})
    assert torch.allclose(again[0], kept[0], atol=1e-6)
    # A query whose own gate is below tau still reads itself.
    lonely = gated_attention_reference(**{**case, "tau": torch.full((4,), 2.0)})
    assert lonely.abs().sum() > 0


def test_cpu_dispatch_is_the_reference_and_bad_kinds_are_refused(monkeypatch) -> None:
    case = random_case(3)
    assert torch.equal(gated_attention(**case), gated_attention_reference(**case))
    with pytest.raises(ValueError, match="attention kind"):
        gated_attention_reference(**{**case, "kind": "relu"})
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "gated_attention=cuda")
    with pytest.raises(ValueError, match="SGLANG_KVX_OPS_IMPL"):
        gated_attention(**case)
    monkeypatch.setenv("SGLANG_KVX_OPS_IMPL", "")
    monkeypatch.setenv("SGLANG_KVX_GATED_ATTENTION_IMPL", "torch")  # retired: said so, not ignored
    with pytest.raises(ValueError, match="replaced by SGLANG_KVX_OPS_IMPL"):
        gated_attention(**case)


def test_triton_kernel_matches_the_reference_under_the_interpreter() -> None:
    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_ops_gated_attention import random_case\n"
        "from sglang_kvx.ops.gated_attention import gated_attention\n"
        "from sglang_kvx.ops.triton_gated_attention import gated_attention_triton\n"
        "for kind in ('sigmoid', 'softmax'):\n"
        "    for gated, decode in ((True, False), (True, True), (False, True)):\n"
        "        case = random_case(4, kind, gated, decode=decode)\n"
        "        want = gated_attention(**case, impl='torch')\n"
        "        got = gated_attention(**case, impl='triton')\n"
        "        small = gated_attention_triton(**case, block_n=4)\n"
        "        print(kind, gated, decode, float((got - want).abs().max()), float((small - want).abs().max()))\n"
        "    from test_ops_gated_attention import fold\n"
        "    case = random_case(6, kind, True, decode=True, tau=0.4)\n"
        "    moved, folded = fold(case, drop_below=0.4)\n"
        "    want = gated_attention(**moved, folded=folded, impl='torch')\n"
        "    got = gated_attention(**moved, folded=folded, impl='triton')\n"
        "    small = gated_attention_triton(**moved, folded=folded, block_n=4)\n"
        "    print(kind, 'folded', 'decode', float((got - want).abs().max()), float((small - want).abs().max()))\n"
    )
    lines = interpreted_lines(code)
    assert len(lines) == 8, lines
    for line in lines:
        *_, err, err_small = line.split()
        assert float(err) < 1e-4 and float(err_small) < 1e-4, line


def fold(case: dict, drop_below: float | None = None) -> tuple[dict, FoldedKeys]:
    """Move each decode row's keys [2, seq_len - 3) out of the row into extra cells (dropping those
    with g < drop_below), and point the row's cells there at garbage (they must not be read)."""
    hidden_from, hidden_to, keys, values, gates, indptr = [], [], [], [], [], [0]
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    for b in range(case["rows"].numel()):
        length = int(case["seq_lens"][b])
        lo, hi = (2, length - 3) if length > 6 else (0, 0)
        slots = case["req_to_token"][case["rows"][b], lo:hi].long()
        if drop_below is not None and case["key_gate"] is not None:
            slots = slots[case["key_gate"][slots] >= drop_below]
        keys.append(k_cache[slots].clone())
        values.append(v_cache[slots].clone())
        gates.append(case["key_gate"][slots].clone() if case["key_gate"] is not None else torch.empty(0))
        hidden_from.append(lo)
        hidden_to.append(hi)
        indptr.append(indptr[-1] + slots.numel())
        moved = case["req_to_token"][case["rows"][b], lo:hi].long()
        k_cache[moved] = 1e3  # freed cells another request overwrote
        v_cache[moved] = -1e3
    folded = FoldedKeys(torch.tensor(hidden_from), torch.tensor(hidden_to), torch.cat(keys), torch.cat(values),
                        torch.cat(gates) if case["key_gate"] is not None else None, torch.tensor(indptr))
    return {**case, "k_cache": k_cache, "v_cache": v_cache}, folded


@pytest.mark.parametrize("kind", ["sigmoid", "softmax"])
@pytest.mark.parametrize("gated", [True, False])
def test_a_folded_row_reads_its_moved_keys_as_the_unfolded_row(kind, gated) -> None:
    case = random_case(5, kind, gated, decode=True, tau=0.4)
    want = gated_attention_reference(**case)
    moved, folded = fold(case)
    assert torch.allclose(gated_attention_reference(**moved, folded=folded), want, atol=1e-5)
    if gated:  # folding only the kept keys is the same again: the rule deletes the others anyway
        moved, folded = fold(case, drop_below=0.4)
        assert torch.allclose(gated_attention_reference(**moved, folded=folded), want, atol=1e-5)
