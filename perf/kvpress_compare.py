"""An outside reference: NVIDIA kvpress and this project's SGLang server on the same prompts (issue #42).

    OMP_NUM_THREADS=1 .venv/bin/python perf/kvpress_compare.py --setup      # once: .venv-kvpress (below)
    OMP_NUM_THREADS=1 .venv/bin/python perf/kvpress_compare.py [--policies keydiff,snapkv] [--fractions 0.5,0.2,0.1] \\
        [--tasks niah_single_1,niah_single_2,niah_multivalue] [--length 1024] [--samples 10] [--seed 0] \\
        [--max-new-tokens 32] [--url URL] [--out FILE] [--answers DIR [--side kvpress|server|both]] \\
        [--kvzap-thresholds=-6,-5 [--kvzap-kinds mlp,linear]]

For every policy both implement and every keep fraction p (and the full cache, p = 1) it prints one
JSON object: each side's suite score (RULER metric x 100, the runner's ``METRICS`` on ``postprocess``ed
answers, mean over every prompt), how many answers are the same (after ``postprocess``), and every
prompt's two answers.

Prompts: ``sglang_kvx.eval.tasks.generate_sample(task, length, seed, index)`` for index
0..samples-1, as ``python -m sglang_kvx.eval`` generates them. As in its runner the context is raw text,
no chat template: the server gets the context alone as a prefill-only parent carrying the policy and p
in ``custom_params.kvx`` (one compacting server serves every policy), then context + question as a
greedy child of the compacted parent (``max_new_tokens``, 32 by default as in the runner), then
``/flush_cache``. kvpress gets the same tokens: the context's ids and the question's ids (the prompt's
ids after the context's, checked to be a prefix, and the server's ``prompt_tokens`` checked against
them) tokenized here with the server's tokenizer, and runs its pipeline's own compress-then-answer code
on them (``perf/kvpress_worker.py``; only the pipeline's preprocessing, which would add the chat
template, is left out). Each side's children are checked to have read a compacted context
(``meta_info["kvx"]``).

Policies both implement (press defaults, ``compression_ratio = 1 - p``), with the differences the
policy docstrings state (``sglang_kvx/policies/*.py``): kvpress keeps ``int((1 - ratio) * n)`` entries
per head where the server keeps ``round(p * n)`` (one entry fewer at some p); KVzipPress and the
server's ``kvzip`` both keep one threshold over every layer and KV head with 4 sinks (allocation
``global``), kvpress reconstructing in chunks of 2048 tokens and the server in chunks of 2000;
ObservedAttentionPress (kvpress's H2O) scores mean attention per query and has
no recent window, the server's ``h2o`` ranks raw sums with half its budget a recent window;
PyramidKVPress counts every layer of the model; RandomPress is given ``seed=0`` (default: unseeded)
and draws other numbers than the server. No kvpress press is TriAttention or GateSight.
One more, kvpress's and only visible on raw-text prompts: KVzipPress takes the first tokens of the
context to be the chat template's system prompt and user header (their count from the tokenizer's
template: 24 on SmolLM2-135M-Instruct) and neither reconstructs nor scores them, so it evicts positions
4-23 of a raw context first; its reconstruction prompt ends in the template's assistant header, as the
server's does.

KVzap (issue #57): ``--kvzap-thresholds`` adds rows for the paper's rule at each tau, ours (``kvzap`` /
``kvzap_linear``: a server started with ``--kvx-kvzap-threshold tau``, one per tau, the parent's
``kept_fraction`` recorded) against kvpress's own ``DMSPress(KVzapPress(model_type), threshold=tau,
sliding_window_size=128)`` loaded with OUR surrogate (``weights/kvzap/<model>/<kind>``, kvpress's
``KVzapModel`` layout; ``perf/kvpress_worker.py`` says how), its ``compression_ratio`` recorded; each
row gives both sides' mean kept fraction. ``kvzip_plus`` runs against ``KVzipPress(kvzip_plus_normalization=True)``.
``kvzap`` and ``kvzap_linear`` named in ``--policies`` run our budget mode (allocation ``global``) at each
p, which kvpress has no press for: those rows have the server's side only. Differences from kvpress
are stated in ``sglang_kvx/policies/kvzap.py`` and ``kvzip.py``.

Long runs (``--answers DIR``): each side's answers are kept in ``DIR/kvpress.json`` and
``DIR/server.json`` with a fingerprint of the job (model, dtype, methods, the prompts' ids,
max_new_tokens); a run finding a side's file with the same fingerprint reads it instead of running
that side again; while a side runs, each answer is appended to ``DIR/<side>-<job>.partial.jsonl``, so an
interrupted run resumes where it stopped. ``--side kvpress`` or ``--side server`` runs one side only and
stops (two such runs can go side by side; a last run with both files present prints the comparison).
``--server-only`` reports the server's side alone, kvpress's columns empty, and never runs kvpress (our
own figures, where no comparison is wanted: issue #57's 2,048-token table).

Isolation (``--setup``, or the first run): kvpress 0.5.5 pins ``transformers<5.3`` where SGLang 0.5.23
runs on 5.19, so kvpress lives in its own venv, ``.venv-kvpress`` (git-ignored), and runs as a
subprocess; this script imports only the project's code. PyPI's torch is the CUDA build (GBs) and
download.pytorch.org is out of reach here, so the venv reuses ``.venv``'s torch instead:
``python -m venv`` from the base interpreter ``.venv`` was made from (``home`` in its pyvenv.cfg;
``--system-site-packages`` would bring that interpreter's own packages, not ``.venv``'s), then a folder
``.venv-kvpress/reused-torch/`` of symlinks to ``.venv``'s torch, triton and the nvidia-* / cuda-*
distributions torch requires (the CUDA runtime torch links against; their dist-infos make pip count
them as installed), added to the venv's path by a ``.pth`` file and pinned to their versions in a pip
constraints file, then ``pip install kvpress==0.5.5 -c constraints``. pip fills in the rest from
PyPI: transformers 5.2.0, datasets, pandas, pyarrow, accelerate, peft, numpy, and torch's pure-Python
dependencies (sympy, networkx, jinja2, ...) as copies of its own, so it never wants to replace a linked
distribution; nothing under ``.venv`` is written. Measured here: 34 s on a quiet machine (71 s beside
a test run), 661 MB (pyarrow 170 MB, transformers 102 MB, sympy 80 MB, pandas 79 MB). Setup checks
that the venv's torch resolves to ``.venv``'s, a run that the venv holds kvpress 0.5.5; the output
records where the worker's torch came from (``kvpress_side.torch_from``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_VENV = ROOT / ".venv"
KVPRESS_VENV = ROOT / ".venv-kvpress"
WORKER = Path(__file__).resolve().with_name("kvpress_worker.py")
KVPRESS_VERSION = "0.5.5"
REUSED = "reused-torch"  # folder inside .venv-kvpress: symlinks into .venv's site-packages


def _torch_closure() -> dict[str, object]:
    """The distributions of this interpreter's torch that are reused: torch itself, triton and the
    nvidia-* / cuda-* ones in its requirement closure (markers and extras evaluated here).
    Pure-Python dependencies (sympy, networkx, jinja2, ...) are left to pip: the kvpress venv gets
    copies of its own, so pip never wants to replace a linked distribution."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, set[str]] = {}

    def visit(name: str, extras: frozenset[str] = frozenset()) -> None:
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            return
        seen[key] = seen.get(key, set()) | set(extras)
        for line in distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker and not any(requirement.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            visit(requirement.name, frozenset(requirement.extras))

    visit("torch")
    reused = {k for k in seen if k in ("torch", "triton") or k.startswith(("nvidia-", "cuda-"))}
    return {k: distribution(k) for k in sorted(reused)}


def setup_venv(venv: Path = KVPRESS_VENV) -> Path:
    """Create ``venv`` with kvpress installed and ``.venv``'s torch reused; return its python."""
    python = venv / "bin" / "python"
    installed = _kvpress_version(python)
    if installed == KVPRESS_VERSION:
        return python
    if installed is not None:
        raise SystemExit(f"{venv} holds kvpress {installed}, not {KVPRESS_VERSION}: remove the folder and run --setup")
    config = dict(line.split(" = ", 1) for line in (MAIN_VENV / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    base = Path(config["home"]) / f"python{sys.version_info.major}.{sys.version_info.minor}"
    print(f"setting up {venv} (kvpress=={KVPRESS_VERSION}, torch from {MAIN_VENV})", file=sys.stderr)
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    reused = venv / REUSED
    reused.mkdir(exist_ok=True)
    pins = []
    for name, dist in _torch_closure().items():
        pins.append(f"{name}=={dist.version}")
        location = Path(dist.locate_file(""))
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}):
            if top == "__pycache__" or (reused / top).is_symlink():
                continue
            (reused / top).symlink_to(location / top)
    (site / "kvx-reused-torch.pth").write_text(str(reused) + "\n")
    # Pinned: pip fails rather than replace a linked distribution (an uninstall would go through the links).
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    pip = subprocess.run([str(python), "-m", "pip", "install", f"kvpress=={KVPRESS_VERSION}", "-c", str(constraints)],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        raise SystemExit(f"pip install kvpress=={KVPRESS_VERSION} failed in {venv}:\n{pip.stdout[-3000:]}{pip.stderr[-3000:]}")
    check = subprocess.run([str(python), "-c", "import torch, kvpress, os; print(os.path.realpath(torch.__file__))"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if not check.startswith(str(MAIN_VENV.resolve())):
        raise SystemExit(f"{venv}: torch was imported from {check}, not {MAIN_VENV}'s")
    return python


def _kvpress_version(python: Path) -> str | None:
    """The kvpress version installed in the venv of ``python``; None when there is none (or no venv)."""
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('kvpress'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


# Our policy -> (kvpress press, its options besides compression_ratio): every policy both implement.
PRESSES: dict[str, tuple[str, dict]] = {
    "knorm": ("KnormPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "snapkv": ("SnapKVPress", {}),
    "streamingllm": ("StreamingLLMPress", {}),
    "kvzip": ("KVzipPress", {}),
    "pyramidkv": ("PyramidKVPress", {}),
    "h2o": ("ObservedAttentionPress", {}),
    "random": ("RandomPress", {"seed": 0}),
    "kvzip_plus": ("KVzipPress", {"kvzip_plus_normalization": True}),
}
# Ours at p (KVzap's budget mode, allocation "global"): kvpress has no press for it.
OURS_ONLY: dict[str, dict] = {"kvzap": {"allocation": "global"}, "kvzap_linear": {"allocation": "global"}}
KVZAP_KINDS = {"mlp": "kvzap", "linear": "kvzap_linear"}
KVZAP_WINDOW = 128
FULL = "full"


def kvzap_press(model: str, kind: str, threshold: float) -> tuple[str, dict]:
    """kvpress's DMSPress(KVzapPress) spec for the worker, with our surrogate for ``model``."""
    from sglang_kvx.policies.kvzap import find_surrogate

    return "DMSPress", {"scorer": "KVzapPress", "model_type": kind, "surrogate": str(find_surrogate(model, kind)),
                        "threshold": threshold, "sliding_window_size": KVZAP_WINDOW}


def press_of(method: tuple, model: str) -> tuple[str | None, dict]:
    """The kvpress press of a method (policy, p, tau): None for the full cache and for ours-only rows."""
    policy, _, tau = method
    if policy == FULL or (tau is None and policy in OURS_ONLY):
        return None, {}
    if tau is not None:
        return kvzap_press(model, {v: k for k, v in KVZAP_KINDS.items()}[policy], tau)
    return PRESSES[policy]


def build_prompts(tasks: list[str], length: int, samples: int, seed: int, tokenizer) -> list[dict]:
    """The runner's samples, with the ids the server reads: the context's and the question's after them."""
    from sglang_kvx.eval.tasks import generate_sample

    prompts = []
    for task in tasks:
        for index in range(samples):
            sample = generate_sample(task, length, seed=seed, index=index, tokenizer=tokenizer)
            context = tokenizer.encode(sample.context)
            prompt = tokenizer.encode(sample.context + sample.question)
            if prompt[: len(context)] != context:
                raise SystemExit(f"{task} #{index}: the context's tokens are not a prefix of the prompt's")
            prompts.append({"task": task, "index": index, "context": sample.context, "question": sample.question,
                            "answers": sample.answers, "context_ids": context, "question_ids": prompt[len(context):]})
    return prompts


def run_kvpress(python: Path, model: str, dtype: str, methods: list[tuple], prompts: list[dict],
                max_new_tokens: int, progress: Path | None = None) -> dict:
    """kvpress's answers[method][prompt] and its versions, from the worker in the kvpress venv
    (``progress``: a JSONL file the worker appends each answer to and resumes from). Ours-only methods
    get None."""
    runs = [m for m in methods if m[0] == FULL or press_of(m, model)[0] is not None]
    jobs = []
    for method in runs:
        press, options = press_of(method, model)
        jobs.append({"policy": method[0], "keep_fraction": method[1], "press": press, "options": options})
    with tempfile.TemporaryDirectory(prefix="kvx-kvpress-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "answers.json"
        job_path.write_text(json.dumps({
            "model": model, "dtype": dtype, "max_new_tokens": max_new_tokens, "jobs": jobs,
            "prompts": [{"context_ids": p["context_ids"], "question_ids": p["question_ids"]} for p in prompts],
        }))
        subprocess.run([str(python), str(WORKER), str(job_path), str(out_path)] + ([str(progress)] if progress else []),
                       check=True)
        result = json.loads(out_path.read_text())
    answers = iter(result["answers"])
    result["answers"] = [next(answers) if m in runs else None for m in methods]
    return result


def run_server(url: str, methods: list[tuple], prompts: list[dict], max_new_tokens: int,
               progress: Path | None = None) -> list[list[dict]]:
    """The server's answers[method][prompt]: per prompt, per method a parent carrying the policy and p,
    then the question as its child, as ``sglang_kvx.eval.runner.evaluate`` sends them; then /flush_cache.
    ``progress``: a JSONL file each prompt's answers are appended to, and resumed from."""
    from tqdm import tqdm

    from sglang_kvx.eval.runner import _generate, _policy_params, wait_for_second_passes
    from sglang_kvx.serve.launcher import flush_cache

    done: dict[int, list[dict]] = {}
    if progress is not None and progress.exists():
        for line in progress.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed while writing it
                continue
            done[entry["prompt"]] = entry["answers"]
    todo = [i for i in range(len(prompts)) if i not in done]
    if done:
        print(f"{len(done)} prompts' answers kept in {progress}; {len(todo)} to run", file=sys.stderr)
    from sglang_kvx.policies import get_policy

    for i in tqdm(todo, desc="sglang_kvx", unit="ctx", file=sys.stderr):
        prompt, row = prompts[i], []
        for m, (policy, p, tau) in enumerate(methods):
            kvx = {"compact": False} if policy == FULL else {
                **_policy_params(policy), "keep_fraction": p, "protected_prefix_len": 0,
                **(OURS_ONLY.get(policy, {}) if tau is None else {})}
            parent = _generate(url, prompt["context"], 0, kvx)
            if policy != FULL and get_policy(policy).second_pass:
                wait_for_second_passes(url)
            child = _generate(url, prompt["context"] + prompt["question"], max_new_tokens, kvx)
            meta = child["meta_info"]
            served = {"text": child["text"], "ids": child.get("output_ids")}
            if policy == FULL:
                expected = len(prompt["context_ids"]) + len(prompt["question_ids"])
                if meta["prompt_tokens"] != expected:  # the ids kvpress gets are not the ones the server read
                    raise SystemExit(f"{prompt['task']} #{prompt['index']}: the server read {meta['prompt_tokens']} "
                                     f"prompt tokens, the ids tokenized here are {expected}")
            else:
                entry = (meta.get("kvx") or [{}])[-1]
                if not entry.get("child"):
                    kept = (parent["meta_info"].get("kvx") or [{}])[-1]
                    raise SystemExit(f"{prompt['task']} #{prompt['index']} {policy}@{p}: the question was not served "
                                     f"from a compacted context (parent: {kept}; child: {entry})")
                served["slots"] = entry.get("slots")
                # The parent's outcome; a second-pass policy compacts later: its child's slots then say it.
                served["kept_fraction"] = (parent["meta_info"].get("kvx") or [{}])[-1].get("kept_fraction") or (
                    round(entry["slots"] / len(prompt["context_ids"]), 6) if entry.get("slots") else None)
            row.append(served)
        flush_cache(url)
        done[i] = row
        if progress is not None:
            with progress.open("a") as f:
                f.write(json.dumps({"prompt": i, "answers": row}) + "\n")
    return [[done[i][m] for i in range(len(prompts))] for m in range(len(methods))]


def compare(methods: list[tuple], prompts: list[dict], ours: list[list[dict]], theirs: list[list[dict] | None],
            stop_ids: set[int], model: str) -> list[dict]:
    """Per method: both scores, same answers / total (and same generated token ids, a stop token at the
    end left out), both sides' mean kept fraction where it is an outcome, and every prompt's two answers.
    A method kvpress has no press for has its side None."""
    from sglang_kvx.eval.scoring import METRICS, postprocess

    def generated(ids: list[int] | None) -> list[int] | None:
        return ids[:-1] if ids and ids[-1] in stop_ids else ids

    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(sum(values) / len(values), 4) if values else None

    rows = []
    for m, (policy, p, tau) in enumerate(methods):
        scores = {"sglang_kvx": [], "kvpress": []}
        same = same_ids = 0
        per_sample = []
        for k, (prompt, a) in enumerate(zip(prompts, ours[m])):
            b = theirs[m][k] if theirs[m] is not None else None
            texts = {"sglang_kvx": postprocess(a["text"]), "kvpress": postprocess(b["text"]) if b else None}
            for side, text in texts.items():
                if text is not None:
                    scores[side].append(METRICS[prompt["task"]](text, prompt["answers"]))
            same += texts["sglang_kvx"] == texts["kvpress"]
            same_ids += b is not None and a["ids"] is not None and generated(a["ids"]) == generated(b["ids"])
            per_sample.append([prompt["task"], prompt["index"], texts["sglang_kvx"], texts["kvpress"]])
        press, options = press_of((policy, p, tau), model)
        row = {
            "policy": policy, "keep_fraction": None if tau is not None else p, "threshold": tau, "press": press,
            "sglang_kvx": round(100 * sum(scores["sglang_kvx"]) / len(prompts), 2),
            "kvpress": round(100 * sum(scores["kvpress"]) / len(prompts), 2) if theirs[m] is not None else None,
            "same_answers": same if theirs[m] is not None else None,
            "same_token_ids": same_ids if theirs[m] is not None else None, "total": len(prompts),
            "kept_fraction_sglang_kvx": mean([a.get("kept_fraction") for a in ours[m]]) if policy != FULL else 1.0,
        }
        if press == "DMSPress" and theirs[m] is not None:
            row["kept_fraction_kvpress"] = mean([1 - b["kvpress_compression_ratio"] for b in theirs[m]])
        rows.append({**row, "per_sample": per_sample})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true",
                        help=f"create {KVPRESS_VENV.name} (kvpress=={KVPRESS_VERSION}, .venv's torch) if missing and exit")
    parser.add_argument("--policies", default=",".join(PRESSES),
                        help="comma-separated policies of both (%(default)s); the full cache is always a row")
    parser.add_argument("--fractions", default="0.5,0.2,0.1", help="keep fractions p (default: %(default)s)")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multivalue")
    parser.add_argument("--length", type=int, default=1024, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=10, help="prompts per task, index 0.. (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="suite seed (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="greedy answer tokens at most (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder for the server this script starts (default: SmolLM2-135M-Instruct, "
                             "converted once if missing); with --url the server's own model")
    parser.add_argument("--url", default=None,
                        help="a running compacting SGLang server with the extension (--kvx-policy other than none): "
                             "use it instead of starting one; its model is what kvpress loads too")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--answers", default=None, metavar="DIR",
                        help="keep each side's answers in DIR (kvpress.json, server.json) and reuse them when the "
                             "job is the same")
    parser.add_argument("--side", choices=("both", "kvpress", "server"), default="both",
                        help="run one side only and stop (needs --answers; default: %(default)s)")
    parser.add_argument("--server-only", action="store_true",
                        help="report the server's side alone (kvpress's columns empty): our figures where no comparison "
                             "with kvpress is wanted; kvpress is not run")
    parser.add_argument("--kvzap-thresholds", default="",
                        help="KVzap rows at these taus, ours against kvpress's DMSPress(KVzapPress) with our surrogate "
                             "(write --kvzap-thresholds=-6,-5: the values start with a minus)")
    parser.add_argument("--kvzap-kinds", default="mlp,linear", help="surrogates for those rows (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.side != "both" and not args.answers:
        parser.error("--side kvpress|server keeps its answers for a later run: give --answers DIR")

    python = setup_venv()
    if args.setup:
        print(python)
        return 0
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in PRESSES and p not in OURS_ONLY]
    if unknown:
        parser.error(f"no kvpress counterpart for {', '.join(unknown)}; choose from {', '.join([*PRESSES, *OURS_ONLY])}")
    taus = [float(t) for t in args.kvzap_thresholds.split(",") if t]
    kinds = [k for k in args.kvzap_kinds.split(",") if k]
    if any(k not in KVZAP_KINDS for k in kinds):
        parser.error(f"--kvzap-kinds: each one of {', '.join(KVZAP_KINDS)}")
    if taus and args.url:
        parser.error("--kvzap-thresholds starts a server per tau (--kvx-kvzap-threshold): drop --url")
    fractions = [float(f) for f in args.fractions.split(",") if f]
    if any(not 0 < f < 1 for f in fractions):
        parser.error("--fractions: each p must lie in (0, 1) (p = 1 is the full-cache row, always run)")
    tasks = [t for t in args.tasks.split(",") if t]
    methods = ([(FULL, 1.0, None)] + [(policy, p, None) for policy in policies for p in fractions]
               + [(KVZAP_KINDS[kind], 1.0, tau) for kind in kinds for tau in taus])

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from sglang_kvx.serve.launcher import server_or_url

    if args.url:
        import requests
        from served import describe

        served = describe(args.url)
        if served.policy == "none":
            served.refuse("it runs --kvx-policy none: it refuses per-request compaction (start it with a policy)")
        if args.model is not None:
            served.require_model(args.model)
        if "kvzip" in policies or "kvzip_plus" in policies:
            served.require_context(2 * args.length + args.max_new_tokens + 128, "KVzip's reconstruction pass")
        model = served.model_path
        dtype = _served_dtype(model, requests.get(served.url + "/server_info", timeout=60).json().get("dtype"))
    else:
        from sglang_kvx.models.smollm2 import convert_smollm2

        model = args.model or str(convert_smollm2())
        dtype = _served_dtype(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_prompts(tasks, args.length, args.samples, args.seed, tokenizer)

    job = _fingerprint(model, dtype, methods, prompts, args.max_new_tokens)
    kept = Path(args.answers) if args.answers else None
    kvpress_side = _kept(kept, "kvpress", job)
    if kvpress_side is None and args.side != "server" and not args.server_only:
        kvpress_side = _keep(kept, "kvpress", job, run_kvpress(python, model, dtype, methods, prompts, args.max_new_tokens,
                                                               _progress(kept, "kvpress", job)))
    server_side = _kept(kept, "server", job)
    if server_side is None and args.side != "kvpress":
        # As the runner starts its server: every request names its policy, the server's own is irrelevant;
        # KVzap's threshold is the server's (--kvx-kvzap-threshold): one more server per tau.
        second_pass = "kvzip" in policies or "kvzip_plus" in policies
        context_length = (2 if second_pass else 1) * args.length + args.max_new_tokens + 128
        groups: dict = {}
        for method in methods:
            groups.setdefault(method[2], []).append(method)
        by_method, served_info = {}, {}
        for tau, group in groups.items():
            flags = (["--kvx-policy", policies[0] if policies else "random"] if tau is None
                     else ["--kvx-policy", group[0][0], "--kvx-kvzap-threshold", str(tau)])
            server = server_or_url(args.url if tau is None else None, model, *flags,
                                   "--context-length", str(context_length), "--dtype", dtype,
                                   max_total_tokens=max(16384, 16 * args.length))
            with server:
                if args.url is None or tau is not None:
                    info = {"flags": " ".join(server.args), "startup_seconds": round(server.startup_seconds, 1)}
                else:
                    info = served.summary()
                answers = run_server(server.url, group, prompts, args.max_new_tokens,
                                     _progress(kept, "server" if tau is None else f"server-tau{tau:g}", job))
            by_method.update(zip(group, answers))
            served_info["main" if tau is None else f"kvzap threshold {tau:g}"] = info
        server_side = _keep(kept, "server", job, {"server": served_info, "answers": [by_method[m] for m in methods]})
    if server_side is None or (kvpress_side is None and not (args.server_only and args.side != "kvpress")):
        print(f"{args.side} side kept in {kept}; run again without --side to compare", file=sys.stderr)
        return 0
    ours, served_info = server_side["answers"], server_side["server"]

    methods = [tuple(m) for m in methods]
    theirs = kvpress_side["answers"] if kvpress_side is not None else [None] * len(methods)
    rows = compare(methods, prompts, ours, theirs, _stop_ids(model, tokenizer), model)
    versions = kvpress_side["versions"] if kvpress_side is not None else None
    result = {
        "model": Path(model).name, "tasks": tasks, "length": args.length, "seed": args.seed, "samples": args.samples,
        "max_new_tokens": args.max_new_tokens, "dtype": dtype,
        "kvpress_version": versions["kvpress"] if versions else None, "kvpress_side": versions,
        "server": served_info,
        "presses": {(m[0] if m[2] is None else f"{m[0]}@{m[2]:g}"): dict(zip(("press", "options"), press_of(m, model)))
                    for m in methods if m[0] != FULL},
        "per_sample_columns": ["task", "index", "sglang_kvx", "kvpress"],
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def _fingerprint(model: str, dtype: str, methods: list, prompts: list[dict], max_new_tokens: int) -> str:
    import hashlib

    job = [Path(model).name, dtype, methods, [[p["context_ids"], p["question_ids"]] for p in prompts], max_new_tokens]
    return hashlib.sha256(json.dumps(job).encode()).hexdigest()


def _progress(folder: Path | None, side: str, job: str) -> Path | None:
    """Where a side's answers go one by one while it runs (named after the job: never two jobs' answers)."""
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{side}-{job[:16]}.partial.jsonl"


def _kept(folder: Path | None, side: str, job: str) -> dict | None:
    """A side's kept answers for this very job, else None."""
    path = folder / f"{side}.json" if folder is not None else None
    if path is None or not path.exists():
        return None
    kept = json.loads(path.read_text())
    if kept.get("job") != job:
        print(f"{path}: kept for another job; running the {side} side again", file=sys.stderr)
        return None
    print(f"{path}: the {side} side's answers, kept by an earlier run", file=sys.stderr)
    return kept["result"]


def _keep(folder: Path | None, side: str, job: str, result: dict) -> dict:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{side}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"job": job, "result": result}))
        path.with_suffix(".tmp").replace(path)
    return result


def _served_dtype(model: str, server_dtype: str | None = None) -> str:
    """The dtype both sides run in: a running server's ``--dtype``, else the checkpoint's own (what
    ``--dtype auto`` picks; the server this script starts is given it explicitly)."""
    if server_dtype and server_dtype != "auto":
        return {"half": "float16", "float": "float32"}.get(server_dtype, server_dtype)
    config = json.loads((Path(model) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _stop_ids(model: str, tokenizer) -> set[int]:
    """The ids greedy decoding stops at on both sides: the generation config's EOS, and the tokenizer's."""
    path = Path(model) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


if __name__ == "__main__":
    raise SystemExit(main())
