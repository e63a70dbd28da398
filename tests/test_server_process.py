"""``ServerProcess``: a port taken between the pick and the server's bind is picked again.

CI stop 47 lost one run to this: another process bound the port ``free_port`` had just handed out,
uvicorn logged "address already in use" and then waited on its scheduler forever, so the pool waited
300 s and failed the test. The start now sees the bind error, stops that server and picks anew.
"""

from __future__ import annotations

import socket
import sys

import pytest
import requests

from sglang_kvx.serve import launcher


# A stand-in for SGLang's HTTP side, for the suite: what ServerProcess sees of a start (uvicorn binds
# late, logs this line when the port is taken and then waits on its scheduler forever; a bound server
# answers /health_generate). The real SGLang server runs the same test in the long tier.
UVICORN_STAND_IN = """
import http.server, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), type("Health", (http.server.BaseHTTPRequestHandler,), {
        "do_GET": lambda self: (self.send_response(200), self.end_headers()),
        "log_message": lambda self, *args: None}))
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(3600)
server.serve_forever()
"""


def test_a_port_taken_before_the_bind_is_picked_again_stand_in(monkeypatch, tmp_path):
    """The suite's version: the same start logic against a stand-in that fails to bind as uvicorn does."""
    monkeypatch.setattr(launcher.ServerProcess, "command",
                        lambda self: [sys.executable, "-c", UVICORN_STAND_IN, "--port", str(self.port)])
    _start_on_a_taken_port("unused", monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.fresh_process
@pytest.mark.long  # a whole SGLang start that fails at its bind, then one that succeeds: the stand-in above in the suite
def test_a_port_taken_before_the_bind_is_picked_again(demo_paths, monkeypatch, tmp_path):
    _start_on_a_taken_port(demo_paths["tiny-llama"], monkeypatch, tmp_path)


def _start_on_a_taken_port(model_path: str, monkeypatch, tmp_path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: next(picks, None) or real_free_port())
        server = launcher.ServerProcess(model_path, max_total_tokens=1024,
                                        log_path=tmp_path / "server.log", startup_timeout=240)
        assert server.port == taken
        with server:
            assert server.port != taken
            assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


def test_a_port_given_by_the_caller_is_not_changed(tmp_path):
    """Starting nothing: a caller's port is theirs; only a port the class picked may be picked anew."""
    assert launcher.ServerProcess("unused", port=12345, log_path=tmp_path / "a.log").port_chosen is False
    assert launcher.ServerProcess("unused", log_path=tmp_path / "b.log").port_chosen is True
