"""The evaluation runner's smoke path: a real server (the shared compacting hybrid, through
``--url``), a tiny length, one policy; and the server the runner starts itself, refused."""

from __future__ import annotations

import json

import pytest

from sglang_kvx.eval.runner import main, summarize, table


@pytest.mark.slow
def test_runner_sweeps_a_live_server_and_writes_results(tmp_path, compacting_hybrid):
    out = tmp_path / "eval"
    code = main(["--url", compacting_hybrid[0].url, "--tasks", "niah_single_1,qa_1", "--length", "512", "--samples", "2", "--policies", "keydiff",
                 "--fractions", "0.5,0.2", "--max-new-tokens", "12", "--out", str(out)])
    assert code == 0
    rows = json.loads((out / "results.json").read_text())
    methods = {(r["policy"], r["keep_fraction"]) for r in rows}
    assert methods == {("full", 1.0), ("keydiff", 0.5), ("keydiff", 0.2)}
    assert {r["task"] for r in rows} == {"niah_single_1", "qa_1"}
    assert all(0.0 <= r["score"] <= 100.0 and r["questions"] == 2 for r in rows)
    assert (out / "results.csv").read_text().startswith("task,length,policy,keep_fraction,score,questions")
    assert (out / "accuracy_vs_keep_fraction.png").stat().st_size > 1000
    assert "| full | 1 |" in table(rows) and len(summarize(rows)) == 3


@pytest.mark.slow
@pytest.mark.fresh_process
def test_runner_hands_its_estimator_to_the_server(tmp_path):
    """--estimator reaches the server it starts: estimators trained for another checkpoint stop it
    before any model loads, with the reason."""
    import shutil

    from sglang_kvx.models.demo import weights_root

    foreign = tmp_path / "estimator"
    shutil.copytree(weights_root() / "gatesight" / "tiny-hybrid-deep", foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    manifest["model_fingerprint"] = "0" * 64
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="trained for"):
        main(["--tasks", "niah_single_1", "--length", "512", "--samples", "1", "--policies", "gatesight",
              "--fractions", "0.5", "--estimator", str(foreign), "--out", str(tmp_path / "eval")])


def test_runner_refuses_an_estimator_for_a_running_server():
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--estimator", "x"])
    assert exc.value.code == 2
