"""End to end: the real SGLang server (our CPU platform, GDN backend and plugin loaded) against HF transformers.

Every comparison is with an independent HF run of the same weights.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
from pathlib import Path

import pytest
import requests

from sglang_kvx.models.tokenizer import WORDS

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


def make_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def generate_ids(server, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
    response = server.generate(
        {"input_ids": input_ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens, "ignore_eos": True}, **extra}
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("n_words", [12, 400])
def test_generate_matches_hf_greedy(served, n_words):
    name, server, ref = served
    prompt = ref.encode(make_text(n_words, seed=n_words))
    body = generate_ids(server, prompt, max_new_tokens=16)
    assert body["output_ids"] == ref.greedy(prompt, 16), name


def test_text_prompt_matches_hf_greedy(served):
    name, server, ref = served
    text = "The special magic number for river is 48213. " + make_text(60, seed=3)
    response = server.generate({"text": text, "sampling_params": {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == ref.greedy(ref.encode(text), 12), name


def test_prompt_logprobs_match_hf(served):
    """Per-position log-probabilities of the prompt agree with HF float32 to 1e-4 (dense and GDN layers)."""
    name, server, ref = served
    prompt = ref.encode(make_text(300, seed=7))  # spans several 64-token GDN chunks
    body = generate_ids(server, prompt, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
    served_lp = [entry[0] for entry in body["meta_info"]["input_token_logprobs"][1:]]
    expected = ref.prompt_logprobs(prompt)
    assert len(served_lp) == len(expected)
    worst = max(abs(a - b) for a, b in zip(served_lp, expected))
    assert worst <= 1e-4, f"{name}: max |logprob diff| = {worst:.2e}"


def test_decode_logprobs_match_hf(served):
    """Each decoded token's log-probability equals HF's full recomputation of the same sequence to 1e-4
    (decode reads the KV cache and, for the hybrid, the GDN conv and recurrent states)."""
    name, server, ref = served
    prompt = ref.encode(make_text(120, seed=8))
    body = generate_ids(server, prompt, max_new_tokens=16, return_logprob=True)
    out = body["output_ids"]
    served_lp = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
    expected = ref.prompt_logprobs(prompt + out)[len(prompt) - 1 :]
    worst = max(abs(a - b) for a, b in zip(served_lp, expected))
    assert worst <= 1e-4, f"{name}: max |logprob diff| over decode = {worst:.2e}"


def test_chat_completions_match_hf(served):
    name, server, ref = served
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": make_text(40, seed=11)}]
    response = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "demo", "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True, "return_prompt_token_ids": True},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt_ids = ref.chat_ids(messages)
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["response_token_ids"] == ref.greedy(prompt_ids, 10), name


def test_concurrent_requests_each_match_hf(served):
    """A batch of different lengths decodes together; every member still equals its own HF run."""
    name, server, ref = served
    prompts = [ref.encode(make_text(n, seed=100 + n)) for n in (5, 50, 120, 250)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: generate_ids(server, p, max_new_tokens=12), prompts))
    for prompt, body in zip(prompts, bodies):
        assert body["output_ids"] == ref.greedy(prompt, 12), name


def test_shared_context_is_reused_from_radix_cache(served):
    """A prefill-only request commits a context; a later prompt that extends it is served from the cache
    (for the hybrid model this restores the GDN states SGLang cached) and still equals HF."""
    name, server, ref = served
    context = ref.encode(make_text(500, seed=21))
    question = ref.encode(" what is the number for garden?")
    generate_ids(server, context, max_new_tokens=0)
    body = generate_ids(server, context + question, max_new_tokens=12)
    assert body["meta_info"]["cached_tokens"] >= len(context) - 1, body["meta_info"]
    assert body["output_ids"] == ref.greedy(context + question, 12), name


def test_repeated_prompt_reports_cached_tokens(served):
    name, server, ref = served
    prompt = ref.encode(make_text(200, seed=31))
    generate_ids(server, prompt, max_new_tokens=4)
    # The first request's prompt + output sit in the radix tree; the same prompt
    # plus that output is a full hit up to the last token.
    first = generate_ids(server, prompt, max_new_tokens=4)
    second = generate_ids(server, prompt + first["output_ids"], max_new_tokens=4)
    assert second["meta_info"]["cached_tokens"] >= len(prompt), (name, second["meta_info"])


def test_kvx_stats_reads_the_real_pool(served):
    name, server, ref = served
    server.flush()
    idle = server.stats()
    assert idle["policy"] == "none" and idle["keep_fraction"] == 1.0
    assert idle["kv_pool_total_tokens"] > 0
    assert idle["kv_pool_free_tokens"] == idle["kv_pool_total_tokens"], idle  # nothing cached after a flush
    prompt = ref.encode(make_text(300, seed=41))
    generate_ids(server, prompt, max_new_tokens=2)
    busy = server.stats()
    # The finished request's tokens now sit in the radix cache, taken from the pool.
    assert busy["kv_pool_free_tokens"] <= idle["kv_pool_free_tokens"] - len(prompt), busy
    assert busy["kv_pool_free_tokens"] + busy["kv_pool_evictable_tokens"] == busy["kv_pool_total_tokens"], busy
    server.flush()
    assert server.stats()["kv_pool_free_tokens"] == idle["kv_pool_total_tokens"]


def test_too_long_request_is_refused_and_server_keeps_serving(served):
    name, server, ref = served
    too_long = ref.encode(make_text(3000, seed=51))  # > --context-length 4096 tokens
    assert len(too_long) > 4096
    response = server.generate({"input_ids": too_long, "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    assert response.status_code == 400, response.text
    assert "context length" in response.text.lower() or "longer than" in response.text.lower(), response.text
    prompt = ref.encode(make_text(20, seed=52))
    assert generate_ids(server, prompt, max_new_tokens=8)["output_ids"] == ref.greedy(prompt, 8)


def test_kv_fields_a_plain_server_would_ignore_are_refused(served):
    """Launched without the extension's flags the server is plain SGLang: a request asking it for
    compaction or a decode step gets a 400 saying so instead of being served as if it had not asked;
    fields that ask for nothing (compact: false) pass."""
    name, server, ref = served
    prompt = ref.encode(make_text(20, seed=5))
    for kvx, field in (({"policy": "knorm", "keep_fraction": 0.5}, "policy"),
                       ({"decode": {"step": "streamingllm", "window": 8}}, "decode")):
        response = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2,
                                                                             "custom_params": {"kvx": kvx}}})
        assert response.status_code == 400, response.text
        assert f"custom_params.kvx.{field}: this server runs without the KV extension" in response.text
    response = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2,
                                                                         "custom_params": {"kvx": {"compact": False}}}})
    assert response.status_code == 200, response.text


def _parents() -> dict[int, int]:
    """Every process's parent pid, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # a process that ended while we read
                continue
    return parents


def _descendants(pid: int, parents: dict[int, int]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        below = [child for child, parent in parents.items() if parent == current]
        found.extend(below)
        todo.extend(below)
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_pooled_servers_scheduler_and_detokenizer_start_from_the_forkserver(served):
    """The suite's pooled servers run SGLANG_KVX_CPU_FORKSERVER=1 (tests/server_pool.py): the scheduler and
    the detokenizer are children of one forkserver, not of the launcher (SGLang's spawn)."""
    name, server, _ = served
    parents = _parents()
    roles = {pid: _cmdline(pid) for pid in _descendants(server.proc.pid, parents)}
    forkservers = [pid for pid, line in roles.items() if "multiprocessing.forkserver" in line]
    assert len(forkservers) == 1, (name, roles)
    served_by = {line.split()[0] for pid, line in roles.items() if parents.get(pid) == forkservers[0] and line}
    assert {"sglang::scheduler", "sglang::detokenizer"} <= served_by, (name, roles, parents)


def test_a_pooled_servers_launcher_is_forked_from_the_zygote_which_refuses_what_a_fork_would_change(served, server_pool):
    """Pooled servers start from the pool's zygote (tests/server_zygote.py): the launcher's parent is the
    zygote, not pytest. A server whose environment sets a variable the zygote's imports read (the CPU
    platform reads SGLANG_KVX_EMULATE_GRAPHS at import) or one read below Python starts the usual way."""
    name, server, _ = served
    zygote = server_pool.zygote
    assert _parents().get(server.proc.pid) == zygote.pid, (name, zygote.differences(server.env))
    command = server.command()
    assert zygote.fits(command, server.env)
    for variable, value in (("SGLANG_KVX_EMULATE_GRAPHS", "1"), ("OMP_NUM_THREADS", "2")):
        assert not zygote.fits(command, {**server.env, variable: value}), variable
    assert not zygote.fits(["python", "-c", "pass"], server.env)


@pytest.mark.fresh_process
def test_a_launcher_stopped_right_after_its_start_is_stopped(served, server_pool, tmp_path):
    """A forked launcher's pid is handed out once it leads its own session, so stopping it at once
    (``os.killpg``, as ``ServerProcess.stop`` does) reaches it. Before, a stop right after a start could
    find no such process group, wait 30 s and leave the launcher and its scheduler running."""
    name, server, _ = served
    zygote = server_pool.zygote
    command = server.command()
    command[command.index("--port") + 1] = "1"  # a port it cannot bind: it ends by itself if not stopped
    launcher = zygote.launch(command, server.env, tmp_path / "launcher.log")
    try:
        assert os.getpgid(launcher.pid) == os.getsid(launcher.pid) == launcher.pid, name
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        assert launcher.wait(timeout=30) != 0
