"""Issue #44 items 2 and 3 end to end, with real processes (the test is about them, so it starts its
own): two servers of one model sharing ``--kvx-context-dir`` (persistence on) behind SGLang's own
router (``sglang-router``, round robin). A child landing on the server that did not compact its
parent restores the context from disk (``restored_from: "disk"``) and answers token for token as
the child read from the pool does, and as the HF oracle does with the served keep-set. A worker
killed with kill -9 mid-session: the router takes its children elsewhere, where they restore from
disk; a server started afresh on the directory (the restart) restores the killed one's contexts,
and refuses (and removes) a file corrupted on disk, answering its child by a full prefill. Before the kill,
both workers serve 8 concurrent clients through the router for a while (issue #53 item 7): children
of the sessions, long plain requests that push contexts out of a worker's pool (they come back from
the directory), streams closed early and ``max_new_tokens: null`` (``tests/tier_load.py``); both stay
up, every answer equals its reference and both pools balance when idle."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang_kvx.serve.launcher import ServerProcess
from server_pool import FORKSERVER_START
from test_compaction_e2e import GREEDY, disk_settled, served_keep_set, text
from tier_load import Book, Mix, Verdict, balance_problem, crash_excerpt, run_load

pytestmark = [pytest.mark.slow, pytest.mark.fresh_process]

POLICY, P = "keydiff", 0.25
POOL = 4096  # each worker's KV pool and context length
LOAD_SECONDS = 10  # the concurrent load through the router (the soak, test_tier_soak.py, loads one server longer)


def worker(path, directory, zygote) -> ServerProcess:
    # No store reserve: the load's long plain requests may push every context out of a worker's pool. Each
    # worker is a process of its own, forked from the pool's zygote (tests/server_zygote.py).
    return ServerProcess(path, "--kvx-policy", POLICY, "--kvx-keep-fraction", str(P), "--context-length", str(POOL),
                         "--kvx-min-store-fraction", "0", "--kvx-context-dir", str(directory),
                         "--kvx-persist-contexts", "on", "--enable-metrics", max_total_tokens=POOL, env=FORKSERVER_START,
                         **zygote.starting())


def ask(url: str, ids: list[int], max_new_tokens: int) -> dict:
    response = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        **GREEDY, "max_new_tokens": max_new_tokens}}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def outcome(body: dict) -> dict:
    return (body["meta_info"].get("kvx") or [{}])[-1]


def test_servers_sharing_a_context_dir_behind_the_router_restore_each_others_contexts(demo_paths, references, tmp_path,
                                                                                      server_pool):
    pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")
    from sglang_kvx.adapter.router import RouterProcess

    ref = references["tiny-llama"]
    directory = tmp_path / "contexts"
    first, second = (worker(demo_paths["tiny-llama"], directory, server_pool.zygote) for _ in range(2))
    restarted = None
    try:
        with ThreadPoolExecutor(2) as starting:  # side by side: each start waits on imports and loading
            list(starting.map(ServerProcess.start, (first, second)))
        with RouterProcess([first.url, second.url], "round_robin") as router:
            sessions = [ref.encode(text(250, seed=8800 + s)) for s in range(4)]
            questions = [ref.encode(f" Question {q}: which word comes next? Answer:") for q in range(2)]
            children, answers = [], {}
            for s, context in enumerate(sessions):
                parent = ask(router.url, context, 0)
                assert outcome(parent).get("compacted") is True, parent["meta_info"]
                for server in (first, second):  # written by its worker's disk thread, found by the other's scan
                    disk_settled(server, disk_contexts=s + 1)
                for q in (0, 1, 0, 1):  # each question twice: round robin puts the two on both servers
                    body = ask(router.url, context + questions[q], 6)
                    children.append(outcome(body))
                    answers.setdefault((s, q), []).append(body["output_ids"])
            read = [c for c in children if c.get("child")]
            assert len(read) / len(children) >= 0.95, children  # the bar: 95% with the shared directory
            from_disk = [c for c in read if c.get("restored_from") == "disk"]
            assert from_disk, children  # some children landed on the server that did not compact their parent
            for (s, q), outputs in answers.items():  # from the pool or from disk: the same tokens
                assert all(o == outputs[0] for o in outputs), (s, q, outputs)
            stats = [w.stats() for w in (first, second)]
            assert sum(s["disk_files_written"] for s in stats) == len(sessions) and stats[0]["disk_contexts"] == len(sessions)
            assert sum(s["disk_restores"] for s in stats) == len(from_disk)
            assert all(s["disk_files_refused"] == 0 and s["restore_failures"] == 0 for s in stats)
            # The HF oracle with the keep-set the compacting server chose: what a restored child answers.
            owner = next(w for w in (first, second) if any(c["context_tokens"] == len(sessions[0])
                                                          for c in w.stats()["compacted_contexts"]))
            keep = served_keep_set(owner, len(sessions[0]), POLICY, P)
            expected, _ = ref.compacted_generate(sessions[0], keep, questions[0], 6)
            assert answers[(0, 0)][0] == expected

            # Under load: 8 clients through the router, the sessions' children (the references: each
            # (session, question)'s first answer above), long plain requests pushing contexts out of a
            # worker's pool, streams closed early, max_new_tokens null. Both workers stay up.
            book = Book(ref, sessions, questions, pool={key: outputs[0] for key, outputs in answers.items()})
            mix = Mix(answer=6, plain_tokens=(2500, POOL - 200), settings={"policy": POLICY, "keep_fraction": P})
            workers = (first, second)
            evicted = sum(w.stats()["contexts_evicted"] for w in workers)
            records = run_load(router.url, book, LOAD_SECONDS, seed=8900, mix=mix, context_length=POOL, timeout=60,
                               alive=lambda: all(w.proc.poll() is None for w in workers))
            verdict = Verdict.of(records, book, mix)
            dead = [f"worker {i} (exit code {w.proc.returncode}):\n{crash_excerpt(w)}"
                    for i, w in enumerate(workers) if w.proc.poll() is not None]
            assert not dead, (f"{len(dead)} of 2 workers died under the load; requests that failed:\n"
                              + "\n".join(verdict.failed[:12]) + "\n" + "\n".join(dead))
            assert not verdict.failed and not verdict.wrong, (
                f"{len(verdict.failed)} requests failed, {len(verdict.wrong)} wrong answers of {len(records)}:\n"
                + "\n".join(verdict.problems()))
            assert verdict.checked == len(records) and verdict.served["plain"] > 0, dict(verdict.served)
            assert [balance_problem(w) for w in workers] == [None, None]
            evicted = sum(w.stats()["contexts_evicted"] for w in workers) - evicted
            restored = sum(w.stats()["disk_restores"] for w in workers) - len(from_disk)
            print(f"[kvx router load] {LOAD_SECONDS} s x 8 clients: {len(records)} requests, {verdict.checked} answers "
                  f"checked ({dict(verdict.served)}), {evicted} contexts pushed out, {restored} restores from disk")
            assert evicted > 0 and restored > 0, (evicted, restored)  # what the load is for

            # kill -9 one worker mid-session: the router sends its children to the other, which restores
            # the contexts the dead one compacted from disk.
            os.killpg(first.proc.pid, signal.SIGKILL)
            first.proc.wait(30)
            late = [ask(router.url, context + questions[1], 6) for context in sessions]
            assert all(outcome(b).get("child") for b in late), [outcome(b) for b in late]
            assert [b["output_ids"] for b in late] == [answers[(s, 1)][0] for s in range(len(sessions))]
            assert len(second.stats()["compacted_contexts"]) == len(sessions)  # every context now in its pool

        # A fresh server on the directory (the killed one's restart): every context restores from disk.
        restarted = worker(demo_paths["tiny-llama"], directory, server_pool.zygote).start()
        body = ask(restarted.url, sessions[2] + questions[0], 6)
        assert outcome(body).get("restored_from") == "disk" and body["output_ids"] == answers[(2, 0)][0]
        stats = restarted.stats()
        assert stats["disk_contexts"] == len(sessions) and stats["disk_restores"] == 1 and stats["compactions_done"] == 0
        assert stats["disk_tier"]["files_refused_by_reason"] == {}
        metrics = requests.get(restarted.url + "/metrics", timeout=30).text
        assert "sglang:kvx_disk_restores_total" in metrics

        # A corrupted file (one byte flipped on disk) is never served: refused, removed, and its child
        # answered by a full prefill -- the plain model's own tokens -- with the reason.
        manifest = next(m for m in directory.glob("*.json") if json.loads(m.read_text())["context_ids"] == sessions[3])
        tensors = directory / json.loads(manifest.read_text())["tensors"]
        data = bytearray(tensors.read_bytes())
        data[-3] ^= 0x10
        tensors.write_bytes(bytes(data))
        body = ask(restarted.url, sessions[3] + questions[0], 6)
        said = outcome(body)
        assert not said.get("child") and "checksum" in said.get("reason", ""), said
        assert body["output_ids"] == ref.greedy(sessions[3] + questions[0], 6)
        stats = restarted.stats()
        assert stats["disk_tier"]["files_refused_by_reason"] == {"checksum": 1} and stats["restore_failures"] == 1
        assert not manifest.exists() and not tensors.exists() and stats["disk_contexts"] == len(sessions) - 1
    finally:
        for server in (first, second, restarted):
            if server is not None:
                server.stop()
