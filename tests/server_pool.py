"""Real SGLang servers shared by the whole test session, keyed by their launch arguments.

A test asks ``server_pool.get(spec)`` for the server it needs and gets a running one: started on
first use, reused by every later test asking for the same spec. After each test, every server it
used is returned to its start state -- ``/flush_cache`` -- and checked whole: every pool slot free,
nothing in the compacted-context store, no decode row or KVzip pass left behind. A test that
leaves a leak or a dead server fails itself, not the tests after it; a server that died is started
afresh for the next test that asks for it.

Counters in ``/kvx/stats`` are cumulative over a shared server's life: tests assert deltas.

At most ``max_live`` servers run at once (each holds ~2.7 GB over its three processes); the least
recently used one is stopped to make room. ``shared_spec`` names the few configurations that carry
most of the suite, so that tests share servers instead of each starting their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import requests

from server_zygote import Zygote
from sglang_kvx.serve.launcher import ServerProcess, flush_cache, server_env


@dataclass(frozen=True)
class ServerSpec:
    """One launch configuration: what makes two servers interchangeable."""

    model_path: str
    args: tuple[str, ...] = ()
    max_total_tokens: int = 8192
    env: tuple[tuple[str, str], ...] = ()

    @property
    def spins_when_idle(self) -> bool:
        """Several ranks: SGLang's data-parallel controller and tensor-parallel schedulers keep a core
        busy while idle (``--sleep-on-idle`` reaches neither), so such a server is not kept waiting."""
        return any(flag in self.args and self.args[self.args.index(flag) + 1] != "1"
                   for flag in ("--dp-size", "--tp-size"))

    @property
    def label(self) -> str:
        return " ".join([Path(self.model_path).name, *self.args, f"pool={self.max_total_tokens}",
                         *(f"{k}={v}" for k, v in self.env)])


def spec(model_path: str, *args: str, max_total_tokens: int = 8192, env: dict[str, str] | None = None) -> ServerSpec:
    return ServerSpec(str(model_path), tuple(args), max_total_tokens, tuple(sorted((env or {}).items())))


# Small pool and context so bad-input tests can exceed them cheaply.
SERVER_ARGS = ("--context-length", "4096")
MAX_TOTAL_TOKENS = 8192
SPARSE_BUDGET = 32  # tokens per query on the shared sparse servers: 8 four-token blocks
CHUNK = 512  # prefill chunk of the shared chunked-prefill server
SHARED_KINDS = ("plain", "compacting", "recomputing", "chunked", "sparse", "gated_cell", "tiered", "soak")
TIERED_POOL = 2048  # the host-tier server's KV pool: one long request evicts every stored context
# The tiered server's context directory: one per pytest process (its flush empties it; pytest-xdist
# workers start their own servers).
TIERED_DIR = Path(tempfile.gettempdir()) / f"kvx-suite-contexts-{os.getpid()}"
# The soak server (issue #53): a pool that one long request empties, host memory for about four of the
# soak's contexts (~0.5 MB each; at least one context of the whole context length, 1.6 MB), the disk
# below, its own directory.
SOAK_POOL = 3072
SOAK_HOST_GB = 0.002
SOAK_DIR = Path(tempfile.gettempdir()) / f"kvx-suite-soak-{os.getpid()}"


def shared_spec(kind: str, path: str, oda_head: str | Path | None = None, env: dict[str, str] | None = None) -> ServerSpec:
    """The suite's shared launch configurations: every test needing, say, a sparse server asks for
    this one by kind, so they share it. ``env`` lets the compacting server import tests/ modules."""
    if kind == "plain":  # SGLang with the extension loaded and idle (no policy, no decode steps)
        return spec(path, *SERVER_ARGS, "--kvx-policy", "none", max_total_tokens=MAX_TOTAL_TOKENS)
    if kind == "compacting":  # compaction by default (KeyDiff, p = 0.5), per-request decode steps, a
        # recall head (the suite's seeded one), the throwaway test policies and step, /metrics, and the
        # OpenAI routes' cached tokens (--enable-cache-report)
        return spec(path, *SERVER_ARGS, "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.5",
                    "--kvx-decode-steps", "on", "--kvx-oda-head", str(oda_head),
                    "--kvx-policy-modules", "throwaway_policy", "--enable-metrics", "--enable-cache-report",
                    max_total_tokens=MAX_TOTAL_TOKENS, env=env)
    if kind == "recomputing":  # the GDN signals recomputed as on SGLang's own (GPU) kernels' route,
        # SGLang's torch_native attention backend, prefill chunks of 128 tokens
        return spec(path, *SERVER_ARGS, "--kvx-policy", "gatesight", "--kvx-keep-fraction", "0.2",
                    "--attention-backend", "torch_native", "--chunked-prefill-size", "128",
                    max_total_tokens=MAX_TOTAL_TOKENS, env={"SGLANG_KVX_GDN_SIGNALS": "recompute"})
    if kind == "chunked":  # prefill in chunks of CHUNK tokens; plain requests' repeated beginnings
        # of 64+ tokens compacted unasked
        return spec(path, *SERVER_ARGS, "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.2",
                    "--chunked-prefill-size", str(CHUNK), "--kvx-auto-context-min-tokens", "64",
                    max_total_tokens=MAX_TOTAL_TOKENS)
    if kind == "sparse":  # block-sparse attention for every request
        return spec(path, "--kvx-sparse-attention", str(SPARSE_BUDGET), max_total_tokens=4096)
    if kind == "gated_cell":  # a learned-gate family cell, per-request decode steps (and the throwaway
        # one-file step of tests/throwaway_decode.py), float32
        return spec(path, "--dtype", "float32", "--kvx-decode-steps", "on", "--kvx-policy-modules", "throwaway_decode",
                    max_total_tokens=4096, env=env)
    if kind == "tiered":  # a small pool, no store reserve (any request may evict), contexts evicted to
        # host memory and written to disk when stored (issue #44), /metrics
        return spec(path, "--context-length", str(TIERED_POOL), "--kvx-policy", "knorm", "--kvx-keep-fraction", "0.5",
                    "--kvx-min-store-fraction", "0", "--kvx-host-store-gb", "0.5", "--kvx-context-dir", str(TIERED_DIR),
                    "--kvx-persist-contexts", "on", "--enable-metrics", max_total_tokens=TIERED_POOL)
    if kind == "soak":  # every tier under pressure (tests/test_tier_soak.py): KeyDiff at p = 0.25, no store
        # reserve, host memory that lets go to the disk, every compacted context written when stored
        return spec(path, "--context-length", str(SOAK_POOL), "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.25",
                    "--kvx-min-store-fraction", "0", "--kvx-host-store-gb", str(SOAK_HOST_GB),
                    "--kvx-context-dir", str(SOAK_DIR), "--kvx-persist-contexts", "on", max_total_tokens=SOAK_POOL)
    raise ValueError(f"no shared server kind {kind!r}; one of {', '.join(SHARED_KINDS)}")


# A pooled server's scheduler and detokenizer start from a forkserver that imported their SGLang modules
# once (the plugin's SGLANG_KVX_CPU_FORKSERVER, adapter/plugin.py), and its launcher is forked from the
# pool's zygote (tests/server_zygote.py): a tiny-llama start then takes ~12 busy CPU-seconds instead of
# ~24 (forkserver alone) or ~36 (spawn), and the suite starts some 40 servers on 2 cores. Fresh-process
# tests whose subject is not the start itself use both; the launcher's own tests (test_cli, test_docs'
# README commands) start as SGLang does (spawn).
FORKSERVER_START = {"SGLANG_KVX_CPU_FORKSERVER": "1"}


def model_registry_env(model_path: str) -> dict[str, str]:
    """``SGLANG_DISABLED_MODEL_ARCHS`` for one model: SGLang's scheduler imports every module of its model
    registry (~250 of them: 2.4 s of each server start alone, more beside the other worker); a suite
    server needs only the modules that name its model's architectures (the extension's own gated
    models are registered apart, by the plugin). SGLang's own switch, set for the suite's servers only."""
    config = Path(model_path) / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    models = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "models"  # not imported
    unused = [module.stem for module in sorted(models.glob("*.py")) if module.stem != "__init__"
              and not any(arch in module.read_text(errors="replace") for arch in architectures)]
    return {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(unused)} if architectures else {}


def whole_pool_problem(stats: dict) -> str | None:
    """Why an idle, flushed server's pool is not back at its start state (None when it is)."""
    ranks = stats["ranks"] if "ranks" in stats else [stats]
    for rank in ranks:
        total, free = rank["kv_pool_total_tokens"], rank["kv_pool_free_tokens"]
        leftovers = {key: rank[key] for key in ("store_slots", "decode_rows", "second_passes_pending", "host_contexts", "disk_contexts")
                     if rank.get(key)}
        if rank.get("compacted_contexts"):
            leftovers["compacted_contexts"] = len(rank["compacted_contexts"])
        if free != total or leftovers:
            return f"pool not whole after /flush_cache: {free} of {total} slots free, left over {leftovers}"
    return None


@dataclass
class ServerPool:
    log_dir: Path
    max_live: int = 5
    live: "OrderedDict[ServerSpec, ServerProcess]" = field(default_factory=OrderedDict)
    starts: list[tuple[str, float, str]] = field(default_factory=list)  # (spec label, seconds to ready, test)
    restarts: int = 0
    used: set[ServerSpec] = field(default_factory=set)  # by the running test
    current: object = None  # the running test's pytest item
    fresh_starts: int = 0  # server processes tests marked fresh_process started themselves
    fresh_by_current: int = 0  # ... by the running test
    starting: bool = False  # the pool is starting a server (conftest's guard lets it through)
    hot: set[ServerSpec] = field(default_factory=set)  # used by many files: the last to be stopped for room
    # The launchers' zygote (tests/server_zygote.py), in the environment every pooled server shares.
    zygote: Zygote = field(default_factory=lambda: Zygote(server_env()))

    def get(self, server_spec: ServerSpec, hot: bool = False) -> ServerProcess:
        """The running server of ``server_spec``, started if need be; ``hot``: one that many test files
        use, which the pool stops for room only when every other live server is hot too."""
        if self.current is not None and self.current.get_closest_marker("slow") is None:
            raise RuntimeError(f"{self.current.nodeid} uses a real server: mark it slow")
        server = self.live.get(server_spec)
        if server is not None and server.proc is not None and server.proc.poll() is not None:
            self._drop(server_spec)  # died after the last test checked it: start afresh
            self.restarts += 1
            server = None
        self.used.add(server_spec)  # before starting: a test whose server failed to start did use one
        if server is None:
            # Room: stop the least recently used server, a cold one before a hot one, never one the
            # running test holds (with none left to stop, the pool runs one over its size).
            while len(self.live) >= self.max_live:
                idle = [s for s in self.live if s not in self.used]
                if not idle:
                    break
                self._drop(next((s for s in idle if s not in self.hot), idle[0]))
            server = self._start(server_spec)
            by = getattr(self.current, "nodeid", "a fixture")
            self.starts.append((server_spec.label, server.startup_seconds or 0.0, by))
            self.live[server_spec] = server
        if hot:
            self.hot.add(server_spec)
        self.live.move_to_end(server_spec)
        self.used.add(server_spec)
        return server

    def _start(self, server_spec: ServerSpec) -> ServerProcess:
        """Start one server (``ServerProcess.start`` picks another port when another process took
        the free one first: pytest-xdist workers pick ports at the same time)."""
        env = {**model_registry_env(server_spec.model_path), **FORKSERVER_START, **dict(server_spec.env)}
        server = ServerProcess(server_spec.model_path, *server_spec.args, max_total_tokens=server_spec.max_total_tokens,
                               env=env, log_path=self.log_dir / f"pooled-{len(self.starts):02d}.log",
                               **self.zygote.starting())
        self.starting = True
        try:
            return server.start()
        finally:
            self.starting = False

    def reset_used(self) -> list[str]:
        """Flush every server the finished test used and check it whole; what went wrong, per server."""
        problems = []
        for server_spec in list(self.used):
            server = self.live.get(server_spec)
            if server is None:
                continue
            if server.proc is None or server.proc.poll() is not None:
                problems.append(f"the shared server [{server_spec.label}] died during this test:\n{server.log_tail(30)}")
                self._drop(server_spec)
                continue
            try:
                problem = self._reset(server)
            except (requests.RequestException, RuntimeError) as exc:
                problem = f"could not be reset ({exc}); it is restarted for the next test"
                self._drop(server_spec)
            if problem:
                problems.append(f"[{server_spec.label}] {problem}")
        for server_spec in [s for s in self.live if s.spins_when_idle and s not in self.used]:
            self._drop(server_spec)  # idle since the last test that used it
        self.used.clear()
        return problems

    @staticmethod
    def _reset(server: ServerProcess, timeout: float = 60.0) -> str | None:
        """``/flush_cache`` until the server is idle and whole (a request a test abandoned may still run)."""
        deadline = time.monotonic() + timeout
        while True:
            flush_cache(server.url, timeout=timeout)
            response = requests.get(server.url + "/kvx/stats", timeout=30)
            response.raise_for_status()
            problem = whole_pool_problem(response.json())
            if problem is None or time.monotonic() > deadline:
                return problem
            time.sleep(0.5)

    def forget(self, server_spec: ServerSpec) -> None:
        """For a test that found its server dead or leaking and fails on that itself, with the log: the
        server is stopped and dropped now (the next test asking for it starts it afresh), so the check
        after the test does not fail it a second time (an error on top of its failure or ``xfail``)."""
        server = self.live.get(server_spec)
        if server is not None:
            self.restarts += server.proc is not None and server.proc.poll() is not None
            self._drop(server_spec)  # still in ``used``: the test did use a server

    def _drop(self, server_spec: ServerSpec) -> None:
        server = self.live.pop(server_spec)
        server.stop()
        server.wait_for_exit()  # its memory is back before the next server sizes its pool

    def close(self) -> None:
        for server_spec in list(self.live):
            self._drop(server_spec)
        self.zygote.close()
        for directory in (TIERED_DIR, SOAK_DIR):  # the shared servers' context directories, this process's own
            shutil.rmtree(directory, ignore_errors=True)
