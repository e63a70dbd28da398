"""The learned-gate paper's protocol pieces (``reference/gated.py``, ``eval/gate_eviction.py``) on
small random inputs and one real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_kvx.eval.gate_eviction import bucket_of, load_cell, select_tau, split_windows, sweep, window_losses
from sglang_kvx.reference.gated import gate_rule, h2o_rule, keydiff_rule, random_rule

CELL = Path(__file__).resolve().parents[1] / "weights" / "gated" / "sigmoid-rope-gate"


def qk(t: int = 40, h: int = 3, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=gen), torch.randn(1, h, t, d, generator=gen)


@pytest.mark.parametrize("rule", [lambda: h2o_rule(12, 24, "softmax"), lambda: h2o_rule(12, 24, "sigmoid"),
                                  lambda: keydiff_rule(12, 24)])
def test_online_baselines_hold_their_budget_and_read_their_own_key(rule) -> None:
    q, k = qk()
    keep = rule()(q, k, None)  # [1, H, T, T]
    assert keep[0, :, :24].all()  # the prefill reads everything (causality is applied by the model)
    rows = keep[0, :, 24:]  # decode queries
    visible = rows & (torch.arange(40)[None, :] <= torch.arange(24, 40)[:, None])
    assert (visible.sum(-1) == 13).all()  # the budget plus the query's own key
    assert rows[:, torch.arange(16), torch.arange(24, 40)].all()  # its own key


def test_h2o_keeps_its_recent_half() -> None:
    q, k = qk()
    keep = h2o_rule(12, 24, "softmax")(q, k, None)[0]
    for i in range(24, 40):
        assert keep[:, i, i - 5 : i + 1].all()  # six most recent (budget 12 // 2), the query included


def test_rules_that_keep_everything_are_the_dense_model() -> None:
    model = load_cell(CELL)
    seqs = split_windows(CELL, "validation", limit=2)
    dense, _ = window_losses(model, seqs, 384)
    for rules in ([gate_rule(0.0, 384)] * 4, [random_rule(0.0, 384, 0)] * 4):
        assert window_losses(model, seqs, 384, lambda _s: rules)[0] == pytest.approx(dense, abs=1e-6)
    points = sweep(model, seqs, 384, taus=(0.0, 0.5, 0.9))
    assert points[0]["compression"] == 0 and points[0]["dppl"] == 0
    assert points[1]["compression"] < points[2]["compression"]  # a higher threshold deletes more


def test_tau_selection_is_the_most_compressing_point_within_the_limit() -> None:
    points = [{"tau": 0.0, "compression": 0.0, "dppl": 0.0}, {"tau": 0.1, "compression": 0.2, "dppl": 0.05},
              {"tau": 0.2, "compression": 0.3, "dppl": 0.2}, {"tau": 0.3, "compression": 0.25, "dppl": 0.09}]
    assert select_tau(points)["tau"] == 0.3  # 25% beats 20%; 30% is over the limit
    assert select_tau(points[:1])["tau"] == 0.0


@pytest.mark.parametrize("surface,bucket", [("\n", "newline"), (" ", "whitespace"), (" 42", "digit"), (",", "punctuation"),
                                            (" the", "stopword"), (" light", "content"), ("The", "stopword")])
def test_token_buckets(surface, bucket) -> None:
    assert bucket_of(surface) == bucket
