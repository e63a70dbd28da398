"""The learned sigmoid-gate eviction model family (sglang_kvx/models/gated.py) and its trainer.

Fast (CPU, tiny shapes). The hand-written references below re-derive the
paper's equations with explicit loops, independent of the model's code paths.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_kvx.models.gated import (
    ALL_CELLS,
    KvxGatedConfig,
    KvxGatedForCausalLM,
    build_model,
    gated_attention,
    register,
)

TINY = dict(vocab_size=61, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=24)


def _tiny(cell: str, seed: int = 0) -> KvxGatedForCausalLM:
    model = build_model(cell, seed=seed, initializer_range=0.3, **TINY)
    return model.eval()


def test_eight_cells_and_the_autoclass_round_trip(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert len(ALL_CELLS) == 8 and len(set(ALL_CELLS)) == 8
    register()
    register()  # idempotent
    model = _tiny("sigmoid-nope-gate")
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "kvx_gated_gpt"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, KvxGatedForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied
    x = torch.randint(0, TINY["vocab_size"], (2, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    for a, b in zip(loaded(x).gates, model(x).gates):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gates_start_at_sigmoid_5_and_only_gated_cells_have_them():
    x = torch.randint(0, TINY["vocab_size"], (2, 7))
    out = _tiny("softmax-rope-gate")(x, labels=x)
    assert len(out.gates) == TINY["num_hidden_layers"] - 1  # every layer but the last
    for g in out.gates:
        assert g.shape == (2, 7)
        torch.testing.assert_close(g, torch.full_like(g, 1 / (1 + math.exp(-5))))
    # loss = CE + 0.03 * mean(g)
    torch.testing.assert_close(out.loss, out.ce_loss + 0.03 * out.gate_mean)
    dense = _tiny("softmax-rope-none")(x, labels=x)
    assert dense.gates is None and dense.gate_mean is None
    torch.testing.assert_close(dense.loss, dense.ce_loss)
    # Same seed: the gate/none twins share every other initial weight.
    gated, plain = _tiny("sigmoid-nope-gate").state_dict(), _tiny("sigmoid-nope-none").state_dict()
    assert all(torch.equal(v, gated[k]) for k, v in plain.items())


@pytest.mark.parametrize("offset", [0, 10])
def test_sigmoid_attention_bias_is_minus_log_i_plus_1(offset):
    model = _tiny("sigmoid-rope-none")
    with torch.no_grad():
        model.model.layers[0].attn.q_proj.weight.zero_()  # q = 0, so every logit z_ij = 0
    t = 6
    x = torch.randint(0, TINY["vocab_size"], (1, t))
    pos = torch.arange(offset, offset + t)[None]
    a = model(x, position_ids=pos, output_attentions=True).attentions[0][0]  # [H, T, T]
    for i in range(t):
        for j in range(t):
            # sigmoid(0 + b(i)) with b(i) = -log(i + 1): 1 / (i + 2), i the absolute position
            want = 1 / (offset + i + 2) if j <= i else 0.0
            assert torch.allclose(a[:, i, j], torch.tensor(want), atol=1e-6), (i, j)
    # Softmax ignores the bias: uniform over the visible keys.
    sm = _tiny("softmax-rope-none")
    with torch.no_grad():
        sm.model.layers[0].attn.q_proj.weight.zero_()
    a = sm(x, output_attentions=True).attentions[0][0]
    torch.testing.assert_close(a[:, 3, :4], torch.full((TINY["num_attention_heads"], 4), 0.25))


def _hand_block(block, x, gate, attention: str, rope: bool, cfg: KvxGatedConfig) -> torch.Tensor:
    """Layer l+1 of the paper, by loops: pre-norm block whose attention sees the previous
    layer's gate g as z_ij += log(g_j + 1e-8) and v_j *= g_j (Sec. 2.3)."""
    T, d = x.shape
    H, D = cfg.num_attention_heads, cfg.head_dim
    h = torch.nn.functional.layer_norm(x, (d,), block.ln_1.weight, block.ln_1.bias, cfg.layer_norm_eps)
    q_all, k_all, v_all = h @ block.attn.q_proj.weight.T, h @ block.attn.k_proj.weight.T, h @ block.attn.v_proj.weight.T

    def rms(u, w):
        return u / torch.sqrt((u * u).mean() + cfg.rms_norm_eps) * w

    def rotate(u, p):  # RoPE: pair (m, m + D/2) rotated by p * theta^(-2m/D)
        out = u.clone()
        for m in range(D // 2):
            ang = p * cfg.rope_theta ** (-2 * m / D)
            c, s = math.cos(ang), math.sin(ang)
            out[m] = u[m] * c - u[m + D // 2] * s
            out[m + D // 2] = u[m] * s + u[m + D // 2] * c
        return out

    heads = []
    for hd in range(H):
        sl = slice(hd * D, (hd + 1) * D)
        q = [rms(q_all[i, sl], block.attn.q_norm.weight) for i in range(T)]
        k = [rms(k_all[j, sl], block.attn.k_norm.weight) for j in range(T)]
        if rope:
            q = [rotate(q[i], i) for i in range(T)]
            k = [rotate(k[j], j) for j in range(T)]
        rows = []
        for i in range(T):
            z = torch.stack([q[i] @ k[j] / math.sqrt(D) + math.log(gate[j] + 1e-8) for j in range(i + 1)])
            a = torch.softmax(z, 0) if attention == "softmax" else torch.sigmoid(z - math.log(i + 1))
            rows.append(sum(a[j] * gate[j] * v_all[j, sl] for j in range(i + 1)))
        heads.append(torch.stack(rows))
    x = x + torch.cat(heads, dim=-1) @ block.attn.o_proj.weight.T
    h2 = torch.nn.functional.layer_norm(x, (d,), block.ln_2.weight, block.ln_2.bias, cfg.layer_norm_eps)
    return x + torch.nn.functional.gelu(h2 @ block.mlp.fc.weight.T) @ block.mlp.proj.weight.T


@pytest.mark.parametrize("cell", ["softmax-rope-gate", "sigmoid-rope-gate", "sigmoid-nope-gate"])
def test_gate_injection_matches_a_hand_computation(cell):
    torch.manual_seed(1)
    model = _tiny(cell)
    with torch.no_grad():  # a gate far from constant, so the injection matters
        for layer in model.model.layers[:-1]:
            layer.gate.weight.normal_(0, 1.0)
            layer.gate.bias.fill_(0.0)
    x = torch.randint(0, TINY["vocab_size"], (1, 6))
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
        g0 = out.gates[0][0]
        assert g0.min() < 0.5 < g0.max() or g0.std() > 0.05
        # the gate is sigmoid(w . x + b) of layer 0's output
        torch.testing.assert_close(g0, torch.sigmoid(out.hidden_states[1][0] @ model.model.layers[0].gate.weight
                                                     + model.model.layers[0].gate.bias))
        want = _hand_block(model.model.layers[1], out.hidden_states[1][0], g0, model.config.attention,
                           model.config.position == "rope", model.config)
    torch.testing.assert_close(out.hidden_states[2][0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_keep_mask_equals_attention_over_the_kept_keys_only(kind):
    torch.manual_seed(2)
    B, H, T, D = 2, 3, 9, 4
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    pos = torch.arange(5, 5 + T).expand(B, T)
    gate = torch.rand(B, T)
    keep = torch.rand(B, T) > 0.4
    keep[:, 0] = True
    full, a = gated_attention(q, k, v, pos, pos, kind, key_gate=gate, keep=keep)
    assert (a.masked_select(~keep[:, None, None, :].expand_as(a)) == 0).all()
    for b in range(B):
        idx = keep[b].nonzero().squeeze(1)
        sub, _ = gated_attention(q[b:b + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx], pos[b:b + 1],
                                 pos[b:b + 1, idx], kind, key_gate=gate[b:b + 1, idx])
        torch.testing.assert_close(full[b:b + 1], sub)
    # A per-query mask [B, Tq, Tk]: deleting keys for the last query only leaves the other rows unchanged.
    per_query = torch.ones(B, T, T, dtype=torch.bool)
    per_query[:, -1] = keep
    mixed, _ = gated_attention(q, k, v, pos, pos, kind, key_gate=gate, keep=per_query)
    plain, _ = gated_attention(q, k, v, pos, pos, kind, key_gate=gate)
    torch.testing.assert_close(mixed[:, :, :-1], plain[:, :, :-1])
    torch.testing.assert_close(mixed[:, :, -1], full[:, :, -1])


def test_model_keep_masks_per_layer():
    model = _tiny("sigmoid-rope-gate")
    x = torch.randint(0, TINY["vocab_size"], (2, 8))
    L = TINY["num_hidden_layers"]
    with torch.no_grad():
        base = model(x).logits
        all_kept = model(x, keep_masks=[torch.ones(2, 8, dtype=torch.bool)] * L).logits
        torch.testing.assert_close(all_kept, base, rtol=0, atol=0)
        keep = torch.ones(2, 8, dtype=torch.bool)
        keep[:, 2] = False
        masked = model(x, keep_masks=[None, keep, None]).logits
    assert not torch.allclose(masked[:, 3:], base[:, 3:])  # queries after the deleted key change
    torch.testing.assert_close(masked[:, :2], base[:, :2])  # earlier queries never saw it
    with pytest.raises(ValueError):
        model(x, keep_masks=[None])


def test_training_lowers_the_loss_and_records_a_disjoint_split(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_kvx.training.train_gated import main, split_documents

    out = tmp_path / "gated"
    cells = ["sigmoid-nope-gate", "softmax-rope-none"]
    results = main(["--cells", ",".join(cells), "--out", str(out), "--sources", "pydoc", "--vocab-size", "320",
                    "--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--context", "64",
                    "--batch-size", "4", "--steps", "40", "--warmup", "5", "--lr", "3e-3", "--eval-every", "0",
                    "--eval-windows", "8"])
    assert [r["cell"] for r in results] == cells
    assert [r["cell"] for r in json.loads((out / "summary.json").read_text())] == sorted(cells)
    for cell in cells:
        d = out / cell
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["steps_done"] == 40 and not manifest["partial"]
        assert manifest["final_val_loss"] < manifest["initial_val_loss"] - 0.5
        split = manifest["split"]
        parts = [set(split[k]) for k in ("train", "validation", "test")]
        assert all(parts) and not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
        assert split["unit"] == "document" and manifest["sources"]["pydoc"]["sha256"]
        again = split_documents(sorted(set().union(*parts)), tuple(split["fractions"]), split["seed"])
        assert again == {k: split[k] for k in ("train", "validation", "test")}
        assert (d / "model.safetensors").stat().st_size < 5_000_000
        register()
        model = AutoModelForCausalLM.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
        ids = torch.tensor([tok.encode("The return statement")])
        assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    gated = json.loads((out / cells[0] / "manifest.json").read_text())
    assert gated["final_val_gate_mean"] < 1 / (1 + math.exp(-5))  # the budget term pulls the gates down


def test_every_trainer_option_has_a_help_line_with_its_default():
    from test_cli_help import help_problems

    from sglang_kvx.training.train_gated import build_parser

    parser = build_parser()
    assert help_problems(parser) == []
    parser.format_help()
