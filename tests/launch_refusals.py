"""SGLang's own launch-time argument parsing for many command lines in one process.

``python -m sglang.launch_server ARGS`` loads the plugins, then ``prepare_server_args(ARGS)``: our
hooks add the ``--kvx-*`` flags and validate them (``adapter/plugin.py``) before anything loads.
This worker runs exactly those two steps for each command line it reads (one JSON list per line on
stdin) and answers one JSON line: the exit code (2 for a refusal, 0 when the launch would go on)
and what went to stderr. One process pays SGLang's import once for every refusal the suite checks;
each command line is parsed in a fork of it, so that one line's side effects (``--kvx-policy-modules``
registers policies) do not reach the next, as with separate launches. ``tests/test_cli.py`` keeps
real launches for the wiring itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def main() -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args  # noqa: F401  imported once, before the forks

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answers only
        load_plugins()  # as launch_server does first
    for line in sys.stdin:
        read_end, write_end = os.pipe()
        if os.fork() == 0:  # the child parses; the parent stays as it was after load_plugins
            os.close(read_end)
            with os.fdopen(write_end, "w") as answer:
                answer.write(json.dumps(parse(json.loads(line))))
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as answer:
            reply = answer.read()
        os.wait()
        print(reply or json.dumps({"returncode": 1, "stderr": "the parsing child died without an answer"}), flush=True)


def parse(argv: list[str]) -> dict:
    from sglang.srt.server_args import prepare_server_args

    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            prepare_server_args(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # reported to the test, which fails on it
            code = 1
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    return {"returncode": code, "stderr": err.getvalue()}

if __name__ == "__main__":
    main()
