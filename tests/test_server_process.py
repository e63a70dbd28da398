"""``ServerProcess``: a port taken between the pick and the server's bind is picked again.

CI stop 47 lost one run to this: another process bound the port ``free_port`` had just handed out,
uvicorn logged "address already in use" and then waited on its scheduler forever, so the pool waited
300 s and failed the test. The start now sees the bind error, stops that server and picks anew.
"""

from __future__ import annotations

import socket

import pytest
import requests

from sglang_kvx.serve import launcher


@pytest.mark.slow
@pytest.mark.fresh_process
def test_a_port_taken_before_the_bind_is_picked_again(demo_paths, monkeypatch, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: next(picks, None) or real_free_port())
        server = launcher.ServerProcess(demo_paths["tiny-llama"], max_total_tokens=1024,
                                        log_path=tmp_path / "server.log", startup_timeout=240)
        assert server.port == taken
        with server:
            assert server.port != taken
            assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


def test_a_port_given_by_the_caller_is_not_changed(tmp_path):
    """Starting nothing: a caller's port is theirs; only a port the class picked may be picked anew."""
    assert launcher.ServerProcess("unused", port=12345, log_path=tmp_path / "a.log").port_chosen is False
    assert launcher.ServerProcess("unused", log_path=tmp_path / "b.log").port_chosen is True
