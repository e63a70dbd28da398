"""Every option of the package's commands has a help line, and a help line that names its default.

Covers ``python -m sglang_kvx.eval``, the training commands (``train_demo``, ``train_gatesight``,
``finetune_ruler``) and ``sglang-kvx`` with its subcommands. Each module builds its parser in
``build_parser()``; the check walks every action, subcommands included.
"""

from __future__ import annotations

import argparse

import pytest

from sglang_kvx import cli
from sglang_kvx.eval import retention, runner
from sglang_kvx.training import finetune_ruler, train_demo, train_gated, train_gatesight, train_recall_head

PARSERS = {
    "python -m sglang_kvx.eval": runner.build_parser,
    "python -m sglang_kvx.eval.retention": retention.build_parser,
    "train_recall_head": train_recall_head.build_parser,
    "train_gated": train_gated.build_parser,
    "train_demo": train_demo.build_parser,
    "train_gatesight": train_gatesight.build_parser,
    "finetune_ruler": finetune_ruler.build_parser,
    "sglang-kvx": cli.build_parser,
}


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """One line per option (or subcommand) without a help line, or whose help omits its default."""
    problems = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest: choice.help for choice in action._choices_actions}  # only commands given help=
            for command in action.choices:
                if not (listed.get(command) or "").strip():
                    problems.append(f"{parser.prog} {command}: no help")
            for sub in action.choices.values():
                problems += help_problems(sub)
            continue
        name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
        if action.help is None or action.help == argparse.SUPPRESS or not action.help.strip():
            problems.append(f"{name}: no help")
            continue
        text = formatter._expand_help(action)  # %(default)s and friends filled in, as --help prints it
        shown_default = action.default not in (None, False, argparse.SUPPRESS) and not action.required
        if shown_default and str(action.default) not in text:
            problems.append(f"{name}: help does not say the default {action.default!r}")
    return problems


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_option_has_a_help_line_with_its_default(command):
    parser = PARSERS[command]()
    assert help_problems(parser) == []
    parser.format_help()  # renders (a stray % in a help line would raise here)


def test_the_check_catches_a_missing_help_and_a_missing_default():
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--bare", type=int, default=3)
    parser.add_argument("--silent-default", type=int, default=7, help="a count")
    parser.add_argument("--fine", type=int, default=5, help="a count (default: %(default)s)")
    commands = parser.add_subparsers(dest="command")
    sub = commands.add_parser("go")
    sub.add_argument("--flag", action="store_true")
    assert help_problems(parser) == [
        "p --bare: no help",
        "p --silent-default: help does not say the default 7",
        "p go: no help",
        "p go --flag: no help",
    ]


def test_sglang_kvx_without_a_command_prints_the_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "serve", "build-demo", "convert-smollm2"):
        assert command in out


def test_sglang_kvx_refuses_an_unknown_command_or_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bogus"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["build-demo", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
