"""RULER's scoring (scripts/eval/synthetic/constants.py and scripts/eval/evaluate.py).

string_match_all: per sample, the fraction of expected strings found in the
prediction (case-insensitive substring); used for every synthetic task.
string_match_part: per sample, 1 if any expected string is found; used for QA.
A task's score is the mean over its samples times 100, rounded to 2 decimals.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterable, Sequence

from sglang_kvx.eval.tasks import TASKS, Sample

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` that occur in ``prediction``, ignoring case."""
    pred = prediction.lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` occurs in ``prediction``, ignoring case, else 0.0."""
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    task: string_match_part if task.startswith("qa") else string_match_all for task in TASKS
}


def score_task(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's task score: mean metric over samples x 100, rounded to 2 decimals."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError("need one prediction per reference list, and at least one")
    metric = METRICS[task]
    total = sum(metric(postprocess(p), refs) for p, refs in zip(predictions, references))
    return round(total / len(predictions) * 100, 2)


def score_samples(samples: Iterable[Sample], predictions: Iterable[str]) -> dict[str, dict[int, float]]:
    """Scores grouped by task and target length: {task: {target_length: score}}."""
    groups: dict[tuple[str, int], tuple[list[str], list[list[str]]]] = defaultdict(lambda: ([], []))
    for sample, prediction in zip(samples, predictions, strict=True):
        preds, refs = groups[(sample.task, sample.metadata["target_length"])]
        preds.append(prediction)
        refs.append(sample.answers)
    table: dict[str, dict[int, float]] = defaultdict(dict)
    for (task, length), (preds, refs) in sorted(groups.items()):
        table[task][length] = score_task(task, preds, refs)
    return dict(table)


def metric_table(scores: dict[str, dict[int, float]]) -> str:
    """A markdown table, one row per task and one column per length, with averages."""
    lengths = sorted({n for row in scores.values() for n in row})
    order = [t for t in TASKS if t in scores] + sorted(t for t in scores if t not in TASKS)
    lines = ["| task | " + " | ".join(str(n) for n in lengths) + " | avg |",
             "| --- |" + " --- |" * (len(lengths) + 1)]

    def cells(values: list[float | None]) -> str:
        return " | ".join("" if v is None else f"{v:.2f}" for v in values)

    for task in order:
        row = [scores[task].get(n) for n in lengths]
        present = [v for v in row if v is not None]
        lines.append(f"| {task} | {cells(row)} | {cells([sum(present) / len(present)])} |")
    columns = [[scores[t][n] for t in order if n in scores[t]] for n in lengths]
    means = [sum(c) / len(c) for c in columns]
    lines.append(f"| avg | {cells(means)} | {cells([sum(means) / len(means)])} |")
    return "\n".join(lines)
