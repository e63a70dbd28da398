"""SGLang's own router (the ``sglang-router`` package) as a process, for the tests and benchmarks that
put several servers behind it (issue #44 item 3). Not a dependency of serving: deployments run
``python -m sglang_router.launch_router`` themselves (``docs/deployment.md``)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import requests

from sglang_kvx.serve.launcher import free_port, server_env


class RouterProcess:
    """``python -m sglang_router.launch_router`` over ``worker_urls`` with one routing ``policy``."""

    def __init__(self, worker_urls: list[str], policy: str, *extra: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"router-{policy}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--policy", policy, "--worker-urls", *worker_urls,
             # its metrics exporter's own port: the default (29000) is one for the whole machine
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=server_env())
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> "RouterProcess":
        """Until the router answers a generate request (its Python start alone takes seconds, minutes on
        a loaded 2-core machine; then it checks every worker's health)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited ({self.proc.returncode}); its log: {self.log.name}")
            try:  # up, and its workers registered and healthy (a 503 until the router has checked them)
                probe = requests.post(self.url + "/generate", json={"text": "hello", "sampling_params": {
                    "max_new_tokens": 1}}, timeout=30)
                if probe.status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the router served no request in {timeout:.0f} s; its log: {self.log.name}")

    def log_tail(self, n: int = 40) -> str:
        with open(self.log.name, errors="replace") as handle:
            return "".join(handle.readlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> "RouterProcess":
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()  # __exit__ is not called when __enter__ raises
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
