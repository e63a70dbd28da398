"""The adapter is the one place that names SGLang, and everything it names exists in the installed SGLang."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import sglang_kvx
from sglang_kvx.adapter.contract import SCHEDULER_HOOKS, all_targets, missing_in_installed_sglang

PACKAGE = Path(sglang_kvx.__file__).parent


def test_every_hook_target_and_attribute_exists_in_the_installed_sglang():
    # One readable list on a version bump, instead of a server that misbehaves.
    assert missing_in_installed_sglang() == []


def test_the_contract_lists_targets_once():
    targets = all_targets()
    assert len(targets) == len(set(targets))
    assert all(target.startswith("sglang.") for target in targets)


def test_every_scheduler_hook_names_a_function_of_the_hooks_module():
    from sglang_kvx.adapter import scheduler_hooks

    for name, _kind in SCHEDULER_HOOKS.values():
        assert callable(getattr(scheduler_hooks, name)), name


def _code_mentions_of_sglang(path: Path) -> list[str]:
    """``sglang.`` in code tokens and plain strings of a file (comments and docstrings excluded)."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING:
            previous = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)), None)
            if previous is None or previous.string in (":",) or previous.type == tokenize.NEWLINE:
                continue  # a docstring
            if "sglang." in tok.string:
                found.append(f"{path.name}:{tok.start[0]}")
        elif tok.type == tokenize.NAME and tok.string == "sglang":
            found.append(f"{path.name}:{tok.start[0]}")
    return found


def test_nothing_outside_the_adapter_names_sglang():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "adapter" in path.relative_to(PACKAGE).parts:
            continue
        offenders += _code_mentions_of_sglang(path)
    assert offenders == []


def test_the_check_sees_a_mention():
    # The scan above can fail: it finds the adapter's own imports.
    assert _code_mentions_of_sglang(PACKAGE / "adapter" / "plugin.py")
