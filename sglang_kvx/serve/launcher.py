"""Start and stop a real SGLang server process (SGLang's own launcher, ``adapter.LAUNCH_MODULE``) on loopback.

Used by the demo, the tests and the benchmarks, so all three run the same
launcher a user runs. ``RunningServer`` speaks to a server someone else started
(a benchmark's ``--url``) through the same client helpers.
"""

from __future__ import annotations

from sglang_kvx.adapter import LAUNCH_MODULE

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import requests


class PortTaken(RuntimeError):
    """The server's HTTP port was bound by another process before the server bound it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flush_cache(url: str, timeout: float = 60.0) -> None:
    """POST /flush_cache, retrying while SGLang still counts a just-finished request as pending."""
    deadline = time.monotonic() + timeout
    while True:
        response = requests.post(url + "/flush_cache", timeout=60)
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            response.raise_for_status()
        time.sleep(0.2)


def server_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """A server's environment: ``base`` (this process's by default) with the defaults below and ``extra``."""
    env = dict(os.environ if base is None else base)
    # GDN prefill on two threads hits a denormal slow path (0.2 s -> 17 s); one thread is stable.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class ServerClient:
    """The client helpers every server handle offers; ``url`` is the server's address."""

    url: str

    def generate(self, payload: dict, timeout: float = 300.0) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def flush(self) -> None:
        flush_cache(self.url)

    def stats(self, timeout: float = 30) -> dict:
        """``/kvx/stats``; the scheduler answers between forward steps, so a long step (a KVzip pass
        over a long context) needs a longer ``timeout``."""
        response = requests.get(self.url + "/kvx/stats", timeout=timeout)
        response.raise_for_status()
        return response.json()


class RunningServer(ServerClient):
    """A server already running at ``url`` (started by someone else): ``start`` checks it answers,
    ``stop`` leaves it running."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.startup_seconds: float | None = None

    def start(self) -> "RunningServer":
        requests.get(self.url + "/health", timeout=30).raise_for_status()
        return self

    def stop(self) -> None:
        pass

    def wait_for_exit(self, timeout: float = 30.0) -> None:
        pass

    def __enter__(self) -> "RunningServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        pass


class Launch(Protocol):
    """Another way to start the launcher's process (the test suite forks it from a process that imported
    SGLang once: tests/server_zygote.py): given the command, its environment and the log's path, a process
    in a session of its own whose handle offers ``pid``, ``poll()``, ``wait(timeout)`` and ``returncode``
    as ``subprocess.Popen`` does."""

    def __call__(self, command: list[str], env: dict[str, str], log_path: Path) -> "subprocess.Popen": ...


class ServerProcess(ServerClient):
    """One SGLang server; ``with ServerProcess(...) as server:`` starts it and always stops it."""

    def __init__(
        self,
        model_path: str | Path,
        *args: str,
        max_total_tokens: int = 8192,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
        launch: "Launch | None" = None,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.port = port or free_port()
        self.port_chosen = port is None  # ours to change when another process takes it first
        self.args = list(args)
        if "--max-total-tokens" not in self.args:
            self.args += ["--max-total-tokens", str(max_total_tokens)]
        # An idle SGLang scheduler otherwise spins a core at ~100%; on a 2-core machine it starves
        # whatever runs beside it (the test's HF oracle, another server). It wakes on the next request.
        if "--sleep-on-idle" not in self.args:
            self.args.append("--sleep-on-idle")
        self.env = server_env(env, base=base_env)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="sglang-kvx-", suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.launch = launch
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", LAUNCH_MODULE,
            "--model-path", self.model_path,
            "--host", "127.0.0.1", "--port", str(self.port),
            *self.args,
        ]

    def start(self) -> "ServerProcess":
        """Start the server and wait until it answers ``/health_generate``. A port picked here that
        another process takes between the pick and uvicorn's bind (pytest-xdist workers, SGLang's own
        NCCL / ZMQ ports) is picked again, up to three times; a port given by the caller is not."""
        for attempt in range(3):
            try:
                return self._start_once()
            except PortTaken:
                if not self.port_chosen or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> "ServerProcess":
        t0 = time.perf_counter()
        if self.launch is not None:
            self.proc = self.launch(self.command(), self.env, self.log_path)
        else:
            self._log = open(self.log_path, "w")
            # Own process group: stopping the server stops its scheduler and detokenizer too.
            self.proc = subprocess.Popen(
                self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = t0 + self.startup_timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                if self._port_taken():
                    self.stop()
                    raise PortTaken(f"port {self.port} taken by another process")
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
            # uvicorn that failed to bind does not exit: it waits on the scheduler forever. Looked for
            # before asking, and the question times out soon: the port's taker may accept a request and
            # never answer it.
            if self._port_taken():
                self.stop()
                raise PortTaken(f"port {self.port} taken by another process")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    self.startup_seconds = time.perf_counter() - t0
                    return self
            except requests.RequestException:
                pass  # not up yet
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang server not ready after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def _port_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
                return b"error while attempting to bind on address" in log.read()
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server's processes at once (SIGKILL to its process group). Not a graceful shutdown,
        and neither was SIGTERM to the group: SGLang's scheduler has no handler for it and died at once,
        after which the launcher slept 5 s "before crash diagnostics". Contexts on disk survive this
        as they survive kill -9 (written whole, then renamed)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def wait_for_exit(self, timeout: float = 30.0) -> None:
        """After ``stop()``: until the scheduler and detokenizer processes are gone too (SGLang's take
        seconds). A large server started next would otherwise size its pool while they still hold
        their memory; tests of small servers need not wait."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def server_or_url(url: str | None, model_path: str | Path, *args: str, **kwargs) -> ServerClient:
    """The server at ``url`` when one is given (its own flags stand), else a new ``ServerProcess``."""
    return RunningServer(url) if url else ServerProcess(model_path, *args, **kwargs)


def parse_urls(values: list[str], arms: tuple[str, ...]) -> dict[str, str]:
    """``--url [ARM=]URL`` values -> {arm: url}; a bare URL stands for the only arm."""
    urls: dict[str, str] = {}
    for value in values:
        arm, sep, url = value.partition("=")
        if not sep or arm.startswith("http"):
            if len(arms) != 1:
                raise ValueError(f"--url {value}: name the arm (one of {', '.join(arms)}), as ARM=URL")
            arm, url = arms[0], value
        if arm not in arms:
            raise ValueError(f"--url {value}: unknown arm {arm!r} (one of {', '.join(arms)})")
        urls[arm] = url
    return urls


def add_url_option(parser: argparse.ArgumentParser, arms: tuple[str, ...]) -> None:
    """``--url [ARM=]URL`` (repeatable) on a benchmark: run arm ARM against the server already at URL
    instead of starting one (its own flags, model and pool then stand; the test suite's smoke run
    points the benchmarks at its shared servers)."""
    named = "URL" if len(arms) == 1 else f"ARM=URL (ARM: {', '.join(arms)})"
    parser.add_argument("--url", action="append", default=[], metavar="[ARM=]URL",
                        help=f"{named}: use the server running there instead of starting one; its own flags, "
                             "model and pool stand (repeatable)")


def urls_from_args(parser: argparse.ArgumentParser, values: list[str], arms: tuple[str, ...]) -> dict[str, str]:
    """The parsed ``--url`` values by arm; a bad one is the parser's error (exit 2)."""
    try:
        return parse_urls(values, arms)
    except ValueError as exc:
        parser.error(str(exc))
