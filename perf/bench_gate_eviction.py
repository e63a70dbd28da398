"""Learned sigmoid-gate eviction: the paper's protocol on our eight cells (Li, arXiv 2608.23296).

    OMP_NUM_THREADS=1 python perf/bench_gate_eviction.py [--weights weights/gated] [--val-sequences 51]
        [--test-sequences 32] [--prefill 384] [--out perf/results/gate_eviction] [--write-tau]

In the transformers model with the rules of ``sglang_kvx/reference/gated.py`` (the server is held to
the same rule by tests/test_gate_eviction_e2e.py). Per cell: dense window PPL (Table 1); per gated
cell the validation tau sweep over the paper's 15-point grid and tau* (highest compression with
dPPL < 0.1 against its own tau = 0, frozen before test); on test, the gated PPL and compression at
tau* and online H2O / KeyDiff on the paired dense backbone at the gate's final live-cache size
(Table 3); the random support-removal probe on the dense backbones; attention row-sum CV, gate
binarisation and mean gate per token kind (Sec. 4). Prints one JSON object and writes it, a CSV of
the main table and a plot of the sweeps under ``--out``. ``--write-tau`` stores tau* in each gated
checkpoint's manifest.json (what ``--kvx-decode sigmoid-gate`` serves by default).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import csv
import json
import shlex
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_kvx.eval.gate_eviction import (
    DPPL_LIMIT, TAU_GRID, gate_statistics, load_cell, matched, ppl, random_probe, row_sum_cv, select_tau, split_windows,
    sweep, window_losses,
)
from sglang_kvx.models.gated import ALL_CELLS, cell_name, parse_cell

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=str(ROOT / "weights" / "gated"), help="folder of the eight cells (default: weights/gated)")
    p.add_argument("--val-sequences", type=int, default=51, help="validation windows for the tau sweep (default: 51, all)")
    p.add_argument("--test-sequences", type=int, default=32, help="test windows (default: 32, all)")
    p.add_argument("--probe-sequences", type=int, default=8, help="test windows for the probe and the mechanism statistics (default: 8)")
    p.add_argument("--prefill", type=int, default=384, help="prefill tokens of each 512-token window (default: 384)")
    p.add_argument("--out", default=str(ROOT / "perf" / "results" / "gate_eviction"), help="where the JSON, CSV and plot go")
    p.add_argument("--write-tau", action="store_true", help="store each gated cell's tau* in its manifest.json")
    return p


def plot(sweeps: dict, chosen: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for cell, points in sweeps.items():
        attention, position, _ = parse_cell(cell)
        style = dict(color="tab:green" if attention == "sigmoid" else "tab:red", ls="-" if position == "rope" else "--")
        ax.plot([100 * p["compression"] for p in points], [p["ppl"] for p in points], marker="o", ms=3, label=cell, **style)
        ax.plot([100 * chosen[cell]["compression"]], [chosen[cell]["ppl"]], marker="*", ms=12, **style)
    ax.set_xlabel("hard KV compression (%)")
    ax.set_ylabel("validation window PPL")
    ax.set_yscale("log")
    ax.set_title("tau sweep (stars: tau*, dPPL < 0.1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    weights, out = Path(args.weights), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    any_cell = weights / ALL_CELLS[0]
    val = split_windows(any_cell, "validation", limit=args.val_sequences)
    test = split_windows(any_cell, "test", limit=args.test_sequences)
    probe = test[: args.probe_sequences]
    tokenizer = AutoTokenizer.from_pretrained(str(any_cell))
    models = {cell: load_cell(weights / cell) for cell in tqdm(ALL_CELLS, desc="loading", leave=False)}
    result: dict = {"command": "python perf/bench_gate_eviction.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                    "sequences": {"validation": len(val), "test": len(test), "probe": len(probe), "length": val.shape[1],
                                  "prefill": args.prefill}, "tau_grid": list(TAU_GRID), "dppl_limit": DPPL_LIMIT}
    result["dense_test_ppl"] = {cell: ppl(window_losses(m, test, args.prefill, desc=f"dense {cell}")[0])
                                for cell, m in models.items()}
    sweeps, chosen, table = {}, {}, {}
    for attention in ("softmax", "sigmoid"):
        for position in ("rope", "nope"):
            gated, dense = cell_name(attention, position, "gate"), cell_name(attention, position, "none")
            sweeps[gated] = sweep(models[gated], val, args.prefill, desc=f"sweep {gated}")
            chosen[gated] = select_tau(sweeps[gated])
            table[gated] = matched(models[gated], models[dense], test, args.prefill, chosen[gated]["tau"], desc=gated)
    result["validation_sweeps"] = sweeps
    result["tau_star"] = {cell: p["tau"] for cell, p in chosen.items()}
    result["test_matched"] = table
    result["ordering"] = {
        cell: {"gate_beats_h2o": row["gated_ppl"] < row["h2o_ppl"], "gate_beats_keydiff": row["gated_ppl"] < row["keydiff_ppl"]}
        for cell, row in table.items()}
    result["random_probe"] = {cell: random_probe(models[cell], probe, args.prefill)
                              for cell in ALL_CELLS if cell.endswith("-none")}
    result["row_sum_cv"] = {cell: row_sum_cv(m, probe) for cell, m in models.items()}
    result["gates"] = {cell: gate_statistics(models[cell], probe, tokenizer) for cell in ALL_CELLS if cell.endswith("-gate")}

    (out / "results.json").write_text(json.dumps(result, indent=2))
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["cell", "dense_backbone_ppl", "gated_tau0_ppl", "tau_star", "compression", "gated_ppl", "h2o_ppl", "keydiff_ppl"])
        for cell, row in table.items():
            writer.writerow([cell, f"{row['dense_backbone_ppl']:.3f}", f"{row['gated_own_dense_ppl']:.3f}", row["tau"],
                             f"{100 * row['compression']:.1f}%", f"{row['gated_ppl']:.3f}", f"{row['h2o_ppl']:.3f}",
                             f"{row['keydiff_ppl']:.3f}"])
    plot(sweeps, chosen, out / "tau_sweep.png")
    if args.write_tau:
        for cell, point in chosen.items():
            path = weights / cell / "manifest.json"
            manifest = json.loads(path.read_text())
            manifest["tau"] = point["tau"]
            manifest["tau_selection"] = {"command": result["command"], "rule": f"highest compression with dPPL < {DPPL_LIMIT} "
                                         f"vs tau = 0 on {len(val)} validation windows", **point}
            path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
