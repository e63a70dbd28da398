"""Shared fixtures: the demo checkpoints, their HF references, and real SGLang servers on loopback."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # GDN denormal slow path, see the notes
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from sglang_kvx.models.demo import ensure_demo_models, weights_root  # noqa: E402
from sglang_kvx.reference.hf import HFReference  # noqa: E402
from sglang_kvx.serve.launcher import ServerProcess  # noqa: E402

DEMO = ("tiny-llama", "tiny-hybrid-deep")

# Small pool and context so bad-input tests can exceed them cheaply.
SERVER_ARGS = ("--context-length", "4096")
MAX_TOTAL_TOKENS = 8192


@pytest.fixture(scope="session")
def demo_paths() -> dict[str, str]:
    ensure_demo_models()
    return {name: str(weights_root() / name) for name in DEMO}


@pytest.fixture(scope="session")
def references(demo_paths) -> dict[str, HFReference]:
    return {name: HFReference(path) for name, path in demo_paths.items()}


@pytest.fixture(scope="session", params=DEMO)
def served(request, demo_paths, references):
    """(name, server, reference) for each demo model, one server per model for the session."""
    name = request.param
    server = ServerProcess(demo_paths[name], *SERVER_ARGS, "--kvx-policy", "none", max_total_tokens=MAX_TOTAL_TOKENS)
    server.start()
    yield name, server, references[name]
    server.stop()
