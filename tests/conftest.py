"""Shared fixtures: the demo checkpoints, their HF references, and real SGLang servers on loopback.

Servers come from one session-wide pool (``server_pool``, ``tests/server_pool.py``): a test asks
for the launch configuration it needs and shares it with every other test asking for the same
one; after each test the servers it used are flushed and checked whole. A test that needs a
process of its own (a restart, a kill, a refused launch, an in-process engine) is marked
``fresh_process``; any other server start fails the test. Markers are enforced: a test using a
real server must be marked ``slow`` (``scripts/test.sh --quick`` leaves those out but for the
ones also marked ``quick``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # GDN denormal slow path, see the notes
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from sglang_kvx.models.demo import ensure_demo_models, weights_root  # noqa: E402
from sglang_kvx.reference.hf import HFReference  # noqa: E402

import file_order  # noqa: E402
from server_pool import ServerPool, ServerSpec, shared_spec  # noqa: E402

DEMO = ("tiny-llama", "tiny-hybrid-deep")
TESTS = Path(__file__).resolve().parent

# The pool holds this many servers at once (~2.7 GB each); the least recently used one goes first.
# Under pytest-xdist each worker has a pool of its own: fewer each, for the same memory.
MAX_LIVE_SERVERS = int(os.environ.get("KVX_TEST_MAX_SERVERS", "3" if os.environ.get("PYTEST_XDIST_WORKER") else "5"))


def pytest_configure(config: pytest.Config) -> None:
    config._kvx_started = time.monotonic()  # the suite's wall time, printed at the end


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: file_order.rank(item.nodeid))  # stable: tests keep their order in a file
    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason="needs a CUDA device (marked gpu); this machine has none")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(no_cuda)


# --- the demo models and their references ------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """A second dense architecture (Qwen3), built per worker: no KVzap surrogate or estimator names it."""
    from sglang_kvx.models.demo import build_demo_model

    return str(build_demo_model("tiny-qwen3", tmp_path_factory.mktemp("qwen3") / "tiny-qwen3"))


@pytest.fixture(scope="session")
def demo_paths() -> dict[str, str]:
    ensure_demo_models()
    return {name: str(weights_root() / name) for name in DEMO}


@pytest.fixture(scope="session")
def references(demo_paths) -> dict[str, HFReference]:
    return {name: HFReference(path) for name, path in demo_paths.items()}


class Oracle:
    """HF oracle results several tests need, computed once per session: keyed by the model, the
    token ids and the options, so every test asking for the same one shares it."""

    def __init__(self) -> None:
        self._memo: dict[tuple, object] = {}

    def _once(self, key: tuple, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def signals(self, ref: HFReference, context: list[int], **options):
        """``reference.signals.context_signals`` (a shallow copy: a caller may set fields on it)."""
        import copy

        from sglang_kvx.reference.signals import context_signals

        key = ("signals", ref.model_path, tuple(context), tuple(sorted(options.items())))
        return copy.copy(self._once(key, lambda: context_signals(ref, context, **options)))

    def reconstruction(self, ref: HFReference, context: list[int], **options):
        """``reference.kvzip.reconstruction_attention``: KVzip's second pass on HF."""
        from sglang_kvx.reference.kvzip import reconstruction_attention

        key = ("reconstruction", ref.model_path, tuple(context), tuple(sorted(options.items())))
        return self._once(key, lambda: reconstruction_attention(ref, context, **options))


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


# --- the shared servers ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def server_pool(request, tmp_path_factory):
    pool = ServerPool(log_dir=tmp_path_factory.mktemp("server-logs"), max_live=MAX_LIVE_SERVERS)
    request.config._kvx_pool = pool
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _shared_servers_back_to_start(request, server_pool):
    """Every server the test used is flushed and checked whole; a dead or leaking one fails this test.
    The markers are kept true: a test using a server is ``slow``, a ``slow`` one uses a server."""
    server_pool.used.clear()
    server_pool.current = request.node
    server_pool.fresh_by_current = 0
    yield
    server_pool.current = None
    used_servers = bool(server_pool.used) or server_pool.fresh_by_current > 0
    problems = server_pool.reset_used()
    if request.node.get_closest_marker("slow") is not None and not used_servers:
        problems.append("marked slow but used no real server: drop the marker (or mark the test that starts one)")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


# What starts a server process, in a command line.
SERVER_COMMANDS = ("sglang.launch_server", "sglang_kvx.engine", str(TESTS.parent / "perf"))


@pytest.fixture(scope="session", autouse=True)
def _servers_start_only_in_the_pool(server_pool):
    """A server process started outside the pool (``ServerProcess``, ``python -m sglang.launch_server``,
    an in-process engine's script, a perf script) must belong to a test marked ``fresh_process``."""
    import subprocess

    original = subprocess.Popen.__init__

    def check(args) -> None:
        command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if any(marker in command for marker in SERVER_COMMANDS) and not server_pool.starting:
            node = server_pool.current
            if node is None or node.get_closest_marker("fresh_process") is None:
                raise RuntimeError(f"{node.nodeid if node else 'a fixture'} starts a server of its own: use "
                                   "server_pool.get(...), or mark the test fresh_process if it needs a new process")
            server_pool.fresh_starts += 1
            server_pool.fresh_by_current += 1

    def init(self, args, *rest, **kwargs):
        check(args)
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init
    server_pool.zygote.before_fork = check  # a launcher forked by the zygote is a start too
    yield
    subprocess.Popen.__init__ = original
    server_pool.zygote.before_fork = None


def tests_on_path() -> dict[str, str]:
    """The env that lets server processes import modules from tests/ (``--kvx-policy-modules throwaway_policy``)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session")
def seeded_oda_heads(demo_paths, tmp_path_factory) -> dict[str, Path]:
    """Recall heads with seeded random weights, one per demo model, served by the compacting servers."""
    from test_oda_e2e import seeded_head

    heads = {}
    for name, path in demo_paths.items():
        heads[name] = tmp_path_factory.mktemp(f"oda-{name}")
        seeded_head(path, name, heads[name])
    return heads


@pytest.fixture(scope="session")
def shared_specs(demo_paths, seeded_oda_heads):
    """``shared_specs(kind, model)``: the launch configuration of one of the suite's shared servers
    (``server_pool.SHARED_KINDS``) for a demo model (or, for ``gated_cell``, a learned-gate cell)."""
    from gated_cells import cell_path

    def spec_for(kind: str, model: str) -> ServerSpec:
        path = cell_path(model) if kind == "gated_cell" else demo_paths[model]
        return shared_spec(kind, path, oda_head=seeded_oda_heads.get(model), env=tests_on_path())

    return spec_for


@pytest.fixture
def shared_server(shared_specs, server_pool):
    """``shared_server(kind, model)``: the running server of that shared configuration (the compacting
    ones, which most files use, stay up longest)."""
    return lambda kind, model: server_pool.get(shared_specs(kind, model), hot=kind == "compacting")


# The parameters of the server fixtures below are module-scoped, so pytest runs a file's tests
# grouped by them (all of one model's, then the other's): each server is asked for in one stretch
# instead of alternately, which with few live servers would stop and restart them.


@pytest.fixture(scope="module", params=DEMO)
def demo_model(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=[pytest.param("tiny-llama", marks=pytest.mark.quick), "tiny-hybrid-deep"])
def quick_dense_model(request) -> str:
    """A demo model's name; the dense model's cases are the server tests ``scripts/test.sh --quick`` keeps."""
    return request.param


@pytest.fixture
def served(demo_model, shared_server, references):
    """(name, server, reference) for each demo model on a plain server."""
    return demo_model, shared_server("plain", demo_model), references[demo_model]


@pytest.fixture
def compacting(quick_dense_model, shared_server, references):
    """(name, server, reference) for each demo model on the shared compacting server."""
    name = quick_dense_model
    return name, shared_server("compacting", name), references[name]


@pytest.fixture
def compacting_hybrid(shared_server, references):
    return shared_server("compacting", "tiny-hybrid-deep"), references["tiny-hybrid-deep"]


@pytest.fixture
def compacting_dense(shared_server, references):
    return shared_server("compacting", "tiny-llama"), references["tiny-llama"]


@pytest.fixture
def recomputing_hybrid(shared_server, references):
    return shared_server("recomputing", "tiny-hybrid-deep"), references["tiny-hybrid-deep"]


# --- launch-time refusals, without launching -------------------------------------------------


class LaunchParser:
    """``parse(*args)``: what ``python -m sglang.launch_server *args`` decides before anything loads
    (exit code 2 and our one stderr line for a refusal), from one worker process for the session
    (``tests/launch_refusals.py``: SGLang's own ``load_plugins`` and ``prepare_server_args``)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        from sglang_kvx.serve.launcher import server_env

        self.proc = subprocess.Popen([sys.executable, str(TESTS / "launch_refusals.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=server_env(tests_on_path()))

    def parse(self, *args: str):
        import json
        import subprocess

        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the launch-parsing worker exited with code {self.proc.wait()}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(list(args), answer["returncode"], "", answer["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def launch_parser():
    parser = LaunchParser()
    yield parser
    parser.close()


# --- the end: what the suite cost ---------------------------------------------------------------


def pool_summary(pool: ServerPool) -> dict:
    return {"starts": pool.starts, "restarts": pool.restarts, "fresh": pool.fresh_starts}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands its pool's figures to the controller, which prints them."""
    pool = getattr(session.config, "_kvx_pool", None)
    if pool is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["kvx_pool"] = pool_summary(pool)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``, files sharing servers run on one worker (``tests/file_order.py``)."""
    return file_order.make_file_group_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    summary = getattr(node, "workeroutput", {}).get("kvx_pool")
    if summary is not None:
        node.config.__dict__.setdefault("_kvx_worker_pools", []).append(summary)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The suite's wall time and every server start (a guard against regrowth: the log shows both)."""
    wall = time.monotonic() - config._kvx_started
    pools = list(getattr(config, "_kvx_worker_pools", []))
    if getattr(config, "_kvx_pool", None) is not None:
        pools.append(pool_summary(config._kvx_pool))
    starts = [start for pool in pools for start in pool["starts"]]
    fresh = sum(pool["fresh"] for pool in pools)
    distinct = len({label for label, *_ in starts})
    terminalreporter.write_line(
        f"[kvx suite] wall {wall:.0f} s; server starts: {len(starts)} pooled ({distinct} configurations, "
        f"{sum(seconds for _, seconds, _ in starts):.0f} s to ready, {sum(p['restarts'] for p in pools)} after a crash) "
        f"+ {fresh} fresh processes, over {len(pools)} pool(s)")
    # Each start with the test that asked for it: a configuration started twice on one worker is a
    # file order (tests/file_order.py) that made the pool stop it for room in between.
    for label, seconds, by in starts:
        terminalreporter.write_line(f"  {seconds:5.1f} s  {label}  (for {by})")
