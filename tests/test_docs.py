"""The documentation is checked (issue #43): README.md and docs/*.md name only files that exist, only
flags their commands offer (from each command's own ``--help``), quote the tutorial's code exactly as
the files the suite serves hold it, and the README's quick start runs against a real server with the
answer shapes it documents.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w*-])")  # not a pattern (--kvx-*)
PATH = re.compile(r"(?<![\w.<>*/-])((?:\.{0,2}/)?[\w.<>*-]+(?:/[\w.<>*-]+)*/?)")
SUFFIXES = (".py", ".md", ".sh", ".json", ".jsonl", ".toml", ".txt", ".csv")


def text_of(path: Path) -> str:
    return path.read_text()


def prose_and_code(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text outside fenced blocks (each block replaced by a blank line), and the blocks (lang, body)."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    return FENCE.sub("\n", text), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return heading.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = prose_and_code(text_of(path))
    return {slug(line.lstrip("#")) for line in prose.splitlines() if line.startswith("#")}


# --- links and file paths ------------------------------------------------------------------------

# Paths the docs name that are not in the repository by design: outputs a command writes, checkpoints
# built on demand (not in git), placeholders.
NOT_IN_THE_REPO = ("runs/", "weights/smollm2-135m-instruct", "weights/tiny-qwen3", "weights/tiny-llama-trained",
                   "/tmp/", "document.txt")
SEARCHED = ("", "sglang_kvx", "tests", "perf", "weights")
# A token with a slash is a path when it starts with one of these folders (or names a file).
ROOTS = {"sglang_kvx", "tests", "perf", "weights", "scripts", "docs", ".ci"} | {
    p.name for p in (ROOT / "sglang_kvx").iterdir() if p.is_dir()} | {p.name for p in (ROOT / "weights").iterdir()}


def named_paths(text: str) -> list[str]:
    """Repository paths named in code spans and code blocks: a token with a slash, or a bare name
    with a file suffix (a module file named alone, e.g. ``recorder.py``)."""
    prose, blocks = prose_and_code(text)
    pieces = CODE_SPAN.findall(prose) + [body for lang, body in blocks if lang in ("", "bash")]
    found = []
    for piece in pieces:
        for token in PATH.findall(piece):
            token = token.rstrip(".")
            if token.startswith(("./", "../")) or "..." in token or "<" in token or ">" in token or token.startswith("-"):
                continue
            if token.count("/") == 0 and not token.endswith(".py"):
                continue
            if "/" in token and token.split("/")[0] not in ROOTS and not token.endswith(SUFFIXES):
                continue
            if any(token.startswith(skip) or skip in token for skip in NOT_IN_THE_REPO):
                continue
            if re.match(r"^(https?:|localhost|[\d.]+$)", token) or token.startswith("/"):
                continue
            if "/" in token and not (token.endswith("/") or token.endswith(SUFFIXES) or "." not in token.split("/")[-1]):
                continue
            found.append(token)
    return found


def exists(token: str) -> bool:
    for base in SEARCHED:
        candidate = ROOT / base / token
        if "*" in token:
            if list((ROOT / base).glob(token)):
                return True
        elif candidate.exists():
            return True
    if "/" not in token:  # a bare module file: anywhere in the package, tests or benchmarks
        return any(any(root.rglob(token)) for root in (ROOT / "sglang_kvx", ROOT / "tests", ROOT / "perf"))
    return False


def test_every_relative_link_and_anchor_exists():
    problems = []
    for doc in DOCS:
        prose, _ = prose_and_code(text_of(doc))
        for target in LINK.findall(prose):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (doc.parent / file_part).resolve() if file_part else doc
            if not linked.exists():
                problems.append(f"{doc.name}: link to missing {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{doc.name}: link to missing anchor {target}")
    assert not problems, "\n".join(problems)


def test_every_file_path_the_docs_name_exists():
    problems = sorted({f"{doc.relative_to(ROOT)}: {token}" for doc in DOCS for token in named_paths(text_of(doc))
                       if not exists(token)})
    assert not problems, "paths named in the docs that do not exist:\n" + "\n".join(problems)


def test_the_path_check_can_fail():
    assert named_paths("see `sglang_kvx/no_such_module.py` and `recorder.py`") == [
        "sglang_kvx/no_such_module.py", "recorder.py"]
    assert not exists("sglang_kvx/no_such_module.py") and exists("recorder.py") and exists("sglang_kvx/policies/")


# --- the README's shape, each page's summary -------------------------------------------------------


def test_the_readme_is_short_and_has_no_dated_updates():
    lines = text_of(ROOT / "README.md").splitlines()
    assert len(lines) <= 250, len(lines)
    assert not [line for line in lines if re.search(r"\bupdate\s*:", line, re.I)]
    # The two commands stay the ones CI runs (.ci/run calls the README's test command).
    assert "bash scripts/test.sh" in text_of(ROOT / ".ci" / "run")
    assert "bash scripts/test.sh   #" in text_of(ROOT / "README.md")


def test_every_docs_page_starts_with_a_title_and_a_two_line_summary():
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = text_of(page).splitlines()
        assert lines[0].startswith("# ") and lines[1] == "", page.name
        assert lines[2] and lines[3] and not lines[4], f"{page.name}: a two-line summary under the title"


# --- the tutorial quotes the files the suite serves ------------------------------------------------

QUOTE = re.compile(r"<!-- quoted from (\S+) -->\n```python\n(.*?)\n```", re.S)


def test_the_extending_tutorial_quotes_the_served_files_exactly():
    text = text_of(ROOT / "docs" / "extending.md")
    quotes = QUOTE.findall(text)
    assert len(quotes) >= 5
    for path, body in quotes:
        assert body in text_of(ROOT / path), f"docs/extending.md quotes {path} but the file no longer holds:\n{body[:300]}"
    # the tutorial quotes both files the suite serves, and nothing else
    served = {path for path, _ in quotes}
    assert served == {"tests/throwaway_policy.py", "tests/throwaway_decode.py"}


# --- flags: each offered by the command the docs name it for -----------------------------------------

PY = sys.executable
TRAINING = ("train_demo", "train_gatesight", "finetune_ruler", "train_recall_head", "train_gated", "train_kvzap")
# (pattern naming a command, the key of its --help); the first match at a position wins.
COMMANDS = (
    (re.compile(r"python -m sglang\.launch_server|sglang-kvx serve"), lambda m: "launch_server"),
    (re.compile(r"sglang_kvx\.eval\.retention"), lambda m: "eval.retention"),
    (re.compile(r"python -m sglang_kvx\.eval\b"), lambda m: "eval"),
    (re.compile(r"(?:sglang_kvx\.training\.)?\b(" + "|".join(TRAINING) + r")\b"), lambda m: "training." + m.group(1)),
    (re.compile(r"sglang-kvx (demo|build-demo|convert-smollm2)"), lambda m: "cli." + m.group(1)),
    (re.compile(r"\bperf/(\w+)\.py"), lambda m: "perf." + m.group(1)),
    (re.compile(r"scripts/test\.sh"), lambda m: "test.sh"),
    (re.compile(r"python -m sglang_router\.launch_router"), lambda m: "router"),
)


def help_module(key: str) -> tuple[str, str]:
    """("module" | "path", what runpy runs) for a command other than the launcher."""
    if key in ("eval", "eval.retention"):
        return "module", "sglang_kvx." + key
    if key.startswith("training."):
        return "module", "sglang_kvx." + key
    if key.startswith("cli."):
        return "module", "sglang_kvx.cli"
    if key == "router":  # SGLang's router (the test extra installs it)
        return "module", "sglang_router.launch_router"
    return "path", str(ROOT / "perf" / (key[5:] + ".py"))


def help_in_process(key: str) -> str:
    """``COMMAND --help``'s output, run in this process (runpy, as ``python -m`` or ``python FILE``
    would run it): argparse prints the help and exits before the command does anything."""
    import contextlib
    import io
    import runpy
    import warnings

    if key == "test.sh":  # a shell script: its tiers are the cases it handles
        return " ".join(re.findall(r"^\s*(--\w+)\)", text_of(ROOT / "scripts" / "test.sh"), re.M))
    kind, target = help_module(key)
    argv = [target, *([key[4:]] if key.startswith("cli.") else []), "--help"]
    out, saved, saved_path = io.StringIO(), sys.argv, list(sys.path)
    sys.argv = argv
    if kind == "path":  # as ``python perf/X.py`` runs it: its folder first on the path
        sys.path.insert(0, str(Path(target).parent))
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported already (the suite)
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved, saved_path
    assert exit_.value.code in (0, None), f"{' '.join(argv)} exited with {exit_.value.code}"
    return out.getvalue()


LAUNCHER = ["-m", "sglang.launch_server", "--help"]  # SGLang's own launcher, plugins loaded: only its --help


def launcher_help() -> str:
    """The launcher's ``--help`` in a process of its own (loading SGLang's plugins registers hooks,
    which must not reach this process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([PY, *LAUNCHER], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def units(text: str) -> list[str]:
    """Where a command and its flags sit together: each logical line of a code block (continuations
    joined), and in prose each code span; a span starting ``...`` continues the paragraph's last
    command (``python -m sglang_kvx.eval ...`` ... ``... --seed 400``)."""
    prose, blocks = prose_and_code(text)
    found = []
    for paragraph in re.split(r"\n\s*\n", prose):
        last = ""
        for span in CODE_SPAN.findall(paragraph):
            named = [m.group() for pattern, _ in COMMANDS for m in pattern.finditer(span)]
            found.append(last + " " + span if span.lstrip().startswith("...") and last else span)
            if named:
                last = named[-1]
    for lang, body in blocks:
        if lang in ("", "bash"):
            found += [line for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    return found


def attributed_flags(text: str) -> list[tuple[str | None, str]]:
    """(command key or None, flag) for every flag in the text: a flag belongs to the last command
    named before it in its unit; None when no command precedes it."""
    pairs = []
    for unit in units(text):
        marks = sorted((m.end(), key(m)) for pattern, key in COMMANDS for m in pattern.finditer(unit))
        for match in FLAG.finditer(unit):
            before = [key for end, key in marks if end <= match.start()]
            pairs.append((before[-1] if before else None, match.group()))
    return pairs


def commands_named() -> set[str]:
    """Every command the docs name (its flags are also what a flag named without its command may be)."""
    keys = set()
    for doc in DOCS:
        for unit in units(text_of(doc)):
            keys |= {key(m) for pattern, key in COMMANDS for m in pattern.finditer(unit)}
    return keys - {"launch_server"}


def flag_problems(flags: dict[str, set[str]]) -> set[str]:
    anywhere = set().union(*flags.values())
    problems = set()
    for doc in DOCS:
        for key, flag in attributed_flags(text_of(doc)):
            if key is None:
                # No command named before it: a launcher flag if it is --kvx-*, else any command's.
                ok = flag in flags["launch_server"] if flag.startswith("--kvx-") else flag in anywhere
            else:
                ok = flag in flags[key]
            if not ok:
                problems.add(f"{doc.relative_to(ROOT)}: {flag} (for {key or 'no command named'})")
    return problems


def test_the_flags_table_is_the_schemas():
    """docs/serving.md's table is ``schema.flags_table()`` (regenerate it from there when a setting changes)."""
    from sglang_kvx.schema import flags_table

    assert flags_table() in (ROOT / "docs" / "serving.md").read_text()


@pytest.mark.fresh_process  # the launcher's --help runs in a process of its own (it loads SGLang's plugins)
def test_every_flag_the_docs_name_is_offered_by_its_command():
    flags = {}
    for key in sorted(commands_named()):
        try:
            flags[key] = set(FLAG.findall(help_in_process(key)))
        except Exception:  # noqa: BLE001 - a command without a --help offers no flag: each named is reported
            flags[key] = set()
    flags["launch_server"] = set(FLAG.findall(launcher_help()))
    assert {"--kvx-policy", "--model-path", "--tp-size"} <= flags["launch_server"]
    problems = flag_problems(flags)
    assert not problems, "flags the docs name that their command does not offer:\n" + "\n".join(sorted(problems))


def test_the_flag_attribution_can_fail():
    pairs = attributed_flags("```bash\nsglang-kvx serve --kvx-policy x \\\n    --kvx-nope 1\n```\n\n"
                             "Run `python perf/bench_oda.py --lengths 1` then `... --window 2`; `--kvx-decode`,\n"
                             "every `--kvx-*` flag.\n")
    assert sorted(pairs, key=str) == sorted([("launch_server", "--kvx-policy"), ("launch_server", "--kvx-nope"),
                                    ("perf.bench_oda", "--lengths"), ("perf.bench_oda", "--window"),
                                    (None, "--kvx-decode")], key=str)


# --- the README's quick start, against a real server ------------------------------------------------

CURL = re.compile(r"curl -s localhost:30000(/[\w/]+)(?: -H '[^']*')?(?:\s*\\\n\s*-d '([^']*)')?")


def readme_blocks() -> list[tuple[str, str]]:
    section = text_of(ROOT / "README.md").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return prose_and_code(section)[1]


@pytest.fixture
def quick_start_server(compacting_hybrid):
    """The shared compacting hybrid (KeyDiff at p = 0.5 unless a request names its own)."""
    server, _ = compacting_hybrid
    server.flush()
    return server


def document() -> str:
    from test_frontend_and_openai import CONTEXT

    return CONTEXT.rstrip("\n")


@pytest.mark.slow
def test_the_quick_start_curl_requests_get_the_documented_answers(quick_start_server):
    server = quick_start_server
    calls = [(path, body) for lang, block in readme_blocks() if lang == "bash" for path, body in CURL.findall(block)]
    assert [path for path, _ in calls] == ["/generate", "/generate", "/kvx/stats"]
    (_, parent_body), (_, child_body), _ = calls
    escaped = json.dumps(document())[1:-1]  # the document inside the JSON string the shell passes on
    parent = json.loads(parent_body.replace("<long document>", escaped))
    child = json.loads(child_body.replace("<long document>", escaped).replace("...?", " what is the magic number?"))
    first = requests.post(server.url + "/generate", json=parent, timeout=120)
    assert first.status_code == 200, first.text
    outcome = first.json()["meta_info"]["kvx"][-1]
    assert outcome["compacted"] is True
    assert {"context_tokens", "slots", "kept_fraction", "policy"} <= set(outcome)
    assert outcome["kept_fraction"] == round(outcome["slots"] / outcome["context_tokens"], 6)
    second = requests.post(server.url + "/generate", json=child, timeout=120)
    assert second.status_code == 200, second.text
    answer = second.json()["meta_info"]["kvx"][-1]
    assert answer["child"] is True and answer["context_tokens"] == outcome["context_tokens"]
    assert answer["slots"] == outcome["slots"]
    stats = requests.get(server.url + "/kvx/stats", timeout=30).json()
    [context] = stats["compacted_contexts"]
    assert {"context_tokens", "slots", "kept_entries", "reuse_count"} <= set(context) and context["reuse_count"] == 1
    assert {"kv_pool_total_tokens", "kv_pool_free_tokens", "bytes_freed"} <= set(stats) and stats["bytes_freed"] > 0


def run_readme_python(block: str, server, tmp_path, monkeypatch) -> dict:
    (tmp_path / "document.txt").write_text(document())
    monkeypatch.chdir(tmp_path)
    code = block.replace("http://localhost:30000", server.url)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    return scope


@pytest.mark.slow
def test_the_quick_start_openai_client_makes_a_parent_and_a_child(quick_start_server, tmp_path, monkeypatch):
    [block] = [body for lang, body in readme_blocks() if lang == "python" and "OpenAI(" in body]
    scope = run_readme_python(block, quick_start_server, tmp_path, monkeypatch)
    assert isinstance(scope["answer"].choices[0].text, str)
    [context] = quick_start_server.stats()["compacted_contexts"]
    assert context["reuse_count"] == 1  # the question was a child of the committed document


@pytest.mark.slow
def test_the_quick_start_frontend_program_forks_children(quick_start_server, tmp_path, monkeypatch):
    [block] = [body for lang, body in readme_blocks() if lang == "python" and "sgl.function" in body]
    scope = run_readme_python(block, quick_start_server, tmp_path, monkeypatch)
    answers = scope["state"]["answers"]
    assert len(answers) == 2 and all(isinstance(answer, str) for answer in answers)
    [context] = quick_start_server.stats()["compacted_contexts"]
    assert context["reuse_count"] == 2


# --- what the server reports: the names the docs give exist in the code -----------------------------


def package_source() -> str:
    return "\n".join(path.read_text() for path in (ROOT / "sglang_kvx").rglob("*.py"))


def test_the_stats_keys_and_metrics_serving_md_names_exist_in_the_code():
    serving = text_of(ROOT / "docs" / "serving.md")
    stats_section = serving.split("## /kvx/stats", 1)[1].split("\n## ", 1)[0]
    source = package_source()
    keys = {key for key in CODE_SPAN.findall(stats_section) if re.fullmatch(r"[a-z][a-z0-9_]+", key)}
    missing = sorted(key for key in keys if f'"{key}"' not in source and f"{key}:" not in source)
    assert not missing, f"docs/serving.md names /kvx/stats keys the code does not report: {missing}"
    metrics = set(re.findall(r"sglang:kvx_[a-z_]+", "\n".join(text_of(doc) for doc in DOCS)))
    assert metrics and not sorted(m for m in metrics if f'"{m}"' not in source), "metrics the code does not declare"
