"""The suite's SGLang launchers, forked from one process that imported SGLang's launcher once.

``python -m sglang.launch_server`` spends ~11 busy CPU-seconds importing SGLang (torch, transformers,
FastAPI, the engine) before it reads its first argument; the suite starts some 40 servers on 2 cores.
So each pytest worker keeps one *zygote*: a process that imported the launcher's modules once (the
cyclic collector off during the imports and their objects frozen after, so that forked children do
not copy those pages to collect them) and, for each server, forks a child that does what ``python -m
sglang.launch_server ARGS`` does from there: a session of its own, the log as stdout and stderr, the
server's environment, ``PYTHONPATH`` on ``sys.path``, then SGLang's ``__main__`` (its plugins loaded,
its arguments parsed, its processes started; the scheduler and detokenizer from SGLang's own start
method, the plugin's forkserver in the suite).

What differs from an exec'd launcher is only what a fork keeps: modules already imported, with what
they read from the environment at import. The zygote runs in the environment all the suite's servers
share (none of their own variables) and records every variable read through ``os.environ`` during its
imports: those asked for by name, and those present, which a copy of the environment reads too. A
server whose environment differs from the zygote's in one of those (but for the values the imports
wrote themselves: SGLang and torch point their caches at defaults), or in a variable read below
Python (``OMP_*``, ``PYTHON*`` but ``PYTHONPATH``, ...), starts the usual way (``fits``): today the
graph emulation's servers (the CPU platform reads ``SGLANG_KVX_EMULATE_GRAPHS`` at import) and those
setting ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` (read by SGLang's scheduling policy at import). The
launcher's own tests (tests/test_cli.py, the README's commands in
tests/test_docs.py) always start it the usual way.

Run as a script, this file is the zygote: one JSON request per line on stdin, one answer per line on
stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

# The launcher's modules: SGLang's entry module and the HTTP server it runs (which imports the engine).
IMPORTS = ("sglang.launch_server", "sglang.srt.entrypoints.http_server")
LAUNCH_MODULE = IMPORTS[0]
PER_TEST = ("PYTEST_CURRENT_TEST",)
# Variables read by C libraries or the interpreter at start-up, which os.environ does not see being read.
READ_BELOW_PYTHON = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "PYTHON", "TORCH_", "CUDA_")


def _read_below_python(key: str) -> bool:
    return key != "PYTHONPATH" and key.startswith(READ_BELOW_PYTHON)


class ForkedLauncher:
    """A launcher forked by the zygote: the part of ``subprocess.Popen`` that ``ServerProcess`` uses. Its
    exit status comes from the zygote, its parent (which reaps it when asked)."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


class Zygote:
    """One pytest worker's zygote (started on first use, stopped by ``close``)."""

    def __init__(self, env: dict[str, str]) -> None:
        # Left out: what changes from test to test, which would otherwise read as a difference of the
        # zygote's (a copy of the environment during its imports reads every variable present).
        self.env = {key: value for key, value in env.items() if key not in PER_TEST}
        self._proc: subprocess.Popen | None = None
        self._read_at_import: frozenset[str] = frozenset()
        self._environ: dict[str, str] = {}  # the zygote's environment after its imports (which set a few)
        self._lock = threading.Lock()  # one request and its answer at a time
        self.forks = 0
        self.dead = False  # it died once: every later start is exec'd
        self.before_fork: Callable[[list[str]], None] | None = None  # sees each command forked (the suite's guard)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _ask(self, request: dict) -> dict:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              env=self.env, text=True, start_new_session=True)
                imported = self._answer()
                self._read_at_import = frozenset(imported["read_at_import"])
                self._environ = {key: value for key, value in imported["environ"].items() if key not in PER_TEST}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            return self._answer()

    def _answer(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server zygote exited (code {self._proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the server zygote: {answer['error']}")
        return answer

    def fits(self, command: list[str], env: dict[str, str]) -> bool:
        """Whether a fork gives what exec'ing ``command`` with ``env`` would: SGLang's launcher, and no
        variable the zygote's imports (or the libraries below Python) read differs."""
        if command[:3] != [sys.executable, "-m", LAUNCH_MODULE] or self.dead:
            return False
        try:
            return not self.differences(env)
        except (RuntimeError, OSError) as exc:  # the zygote died (the OOM killer): servers start the usual way
            self.dead = True
            print(f"[kvx zygote] {exc}; starting servers the usual way from now on", file=sys.stderr)
            return False

    def differences(self, env: dict[str, str]) -> set[str]:
        """The variables of ``env`` that a fork of the zygote would not give the launcher."""
        self._ask({"op": "ping"})  # the zygote's imports done, what they read known
        env = {key: value for key, value in env.items() if key not in PER_TEST}
        # Against the environment the imports ran in; a variable they wrote themselves (SGLang and torch
        # point their caches at defaults) is the same where the server's holds the value they wrote.
        differ = {key for key in set(env) | set(self.env) if env.get(key) != self.env.get(key)
                  and not (key not in self.env and env.get(key) == self._environ.get(key))}
        return {key for key in differ if key in self._read_at_import or _read_below_python(key)}

    def launch(self, command: list[str], env: dict[str, str], log_path: Path) -> ForkedLauncher:
        """``ServerProcess``'s ``launch``: a forked launcher where that gives the same process, else exec'd."""
        if not self.fits(command, env):
            log = open(log_path, "w")
            try:
                return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            finally:
                log.close()  # the child holds its own copy
        if self.before_fork is not None:
            self.before_fork(command)
        answer = self._ask({"op": "start", "argv": command[3:], "env": env, "log": str(log_path),
                            "cwd": os.getcwd()})
        self.forks += 1
        return ForkedLauncher(self, answer["pid"])

    def starting(self) -> dict:
        """``ServerProcess`` keywords that start a server from this zygote: its launch, and the zygote's own
        environment as the server's base (the test process's drifts as libraries set variables in it)."""
        return {"launch": self.launch, "base_env": self.env}

    def exit_code(self, pid: int) -> int | None:
        try:
            return self._ask({"op": "poll", "pid": pid})["returncode"]
        except (RuntimeError, OSError):  # the zygote is gone: its launchers were handed to init, which reaps them
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -1  # ended, with a status nobody here can read
            return None

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()  # the zygote exits at the end of its input
            except BrokenPipeError:
                pass  # it is gone already
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


# --- the zygote itself ----------------------------------------------------------------------------


def _import_recording_reads() -> list[str]:
    """Import the launcher's modules; the environment variables read through ``os.environ`` meanwhile."""
    import gc
    import importlib

    read: set[str] = set()
    environ = os.environ

    class RecordingEnviron(type(environ)):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    os.environ = RecordingEnviron(environ._data, environ.encodekey, environ.decodekey,
                                  environ.encodevalue, environ.decodevalue)
    gc.disable()
    try:
        for module in IMPORTS:
            importlib.import_module(module)
    finally:
        os.environ = environ  # os.getenv reads the module global: the original again
        gc.enable()
        gc.freeze()
    return sorted(read)


def _run_launcher(argv: list[str], env: dict[str, str], log: str, cwd: str, ready: int) -> None:
    """In the forked child: become ``python -m sglang.launch_server ARGV`` with ``env``; never returns.
    ``ready``: a pipe's write end, closed once the child leads its own session (see ``main``)."""
    import atexit
    import runpy

    code = 1
    try:
        os.setsid()
        os.close(ready)
        os.chdir(cwd)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:0] = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
        sys.argv = [LAUNCH_MODULE, *argv]
        runpy.run_module(LAUNCH_MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a process ending normally runs (SGLang's and torch's handlers)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    sys.path[0] = os.getcwd()  # as under ``python -m``: the working directory, not this file's folder
    read_at_import = _import_recording_reads()
    out = sys.stdout

    def answer(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()  # before any fork: a child must not inherit unwritten answers

    answer({"read_at_import": read_at_import, "environ": dict(os.environ)})
    exited: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "ping":
            answer({})
        elif op == "start":
            # The pid is answered only once the child leads its own session: a stop right after the start
            # kills its process group (os.killpg(pid)), which before the child's setsid does not exist yet.
            wait_end, ready = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(wait_end)
                _run_launcher(request["argv"], request["env"], request["log"], request["cwd"], ready)
            os.close(ready)
            os.read(wait_end, 1)  # end of file: the child closed its end after setsid (or exited)
            os.close(wait_end)
            answer({"pid": pid})
        elif op == "poll":
            pid = request["pid"]
            if pid not in exited:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    answer({"error": f"{pid} is not a launcher of this zygote"})
                    continue
                if done:
                    exited[pid] = os.waitstatus_to_exitcode(status)
            answer({"returncode": exited.get(pid)})
        else:
            answer({"error": f"unknown request {op!r}"})


if __name__ == "__main__":
    main()
