"""SGLang's own launch-time argument parsing for many command lines in one process.

``python -m sglang.launch_server ARGS`` loads the plugins, then ``prepare_server_args(ARGS)``: our
hooks add the ``--kvx-*`` flags and validate them (``adapter/plugin.py``) before anything loads.
This worker runs exactly those two steps for each command line it reads (one JSON list per line on
stdin) and answers one JSON line: the exit code (2 for a refusal, 0 when the launch would go on)
and what went to stderr. One process pays SGLang's import once for every refusal the suite checks;
``tests/test_cli.py`` keeps real launches for the wiring itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main() -> None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answers only
        load_plugins()  # as launch_server does first
    for line in sys.stdin:
        argv = json.loads(line)
        err, code = io.StringIO(), 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                prepare_server_args(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception as exc:  # reported to the test, which fails on it
                code = 1
                print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        print(json.dumps({"returncode": code, "stderr": err.getvalue()}), flush=True)


if __name__ == "__main__":
    main()
