"""Every combination of a server mode and a request feature is served or refused (issue #41 item 1).

The features are generated from the registries and the schema (every servable policy as a parent
and its child, every decode step with its default options, the request fields' other values) plus
the request shapes SGLang offers (log-probabilities from inside and from past a compacted context,
``n > 1``, streaming, the OpenAI completions and chat routes). The server modes: the dense model
compacting, with chunked prefill, block-sparse, plain; the hybrid GDN model compacting; the dense
model with ``--page-size 16``; a learned-gate checkpoint evicting by its gates; and the hybrid under
``--tp-size 2`` (GateSight by default), run from ``test_parallel.py`` on that file's server, in CI's
long tier (a TP server keeps both cores busy: beside the suite's other worker it starved its servers).
For each mode, each feature is either

- served: 200, and the same tokens when sent again inside a concurrent batch of other requests
  (the feature's own answer does not depend on what else runs); or
- refused: a 4xx whose message names the request field or the reason (``custom_params.kvx`` or
  ``sglang_kvx``), never a 5xx, never a hang (every request under a timeout).

The oracle checks of each served feature live in their own files (compaction, decode steps, ODA,
sparse attention); this file checks the matrix. ``MATRIX`` collects what each pair did; the closing
assertion prints it when something is wrong.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import requests

from sglang_kvx.decode import DECODE_STEPS
from sglang_kvx.policies import servable_policy_names

from test_compaction_e2e import GREEDY, text

MODES = ("compacting", "chunked", "sparse", "plain", "hybrid", "paged", "gated")  # and "tp": test_parallel.py
TIMEOUT = 120
GATED_CELL = "sigmoid-rope-gate"


class _Tokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _server(mode: str, shared_server, server_pool, references, demo_paths):
    """(server, something with ``encode``) of a matrix mode; each is a server other files use too."""
    if mode == "hybrid":
        return shared_server("compacting", "tiny-hybrid-deep"), references["tiny-hybrid-deep"]
    if mode == "paged":
        from test_paged_kv_e2e import paged_spec

        return server_pool.get(paged_spec(demo_paths["tiny-llama"])), references["tiny-llama"]
    if mode == "gated":
        from gated_cells import cell_path
        from test_gate_eviction_e2e import gated_spec

        return server_pool.get(gated_spec(GATED_CELL)), _Tokenizer(cell_path(GATED_CELL))
    return shared_server(mode, "tiny-llama"), references["tiny-llama"]


def _features(ref) -> dict[str, list[tuple[str, dict]]]:
    """name -> the requests it sends, as (route, body); the last one is the one judged."""
    context = ref.encode(text(120, seed=501))
    question = ref.encode(" which word comes next?")

    def body(ids, new=6, **fields):
        params = {**GREEDY, "max_new_tokens": new}
        if fields:
            params["custom_params"] = {"kvx": fields}
        return {"input_ids": ids, "sampling_params": params}

    def parent_and_child(**fields):
        return [("/generate", body(context, 0, **fields)), ("/generate", body(context + question, **fields))]

    features = {f"policy {name}": parent_and_child(policy=name, keep_fraction=0.5) for name in servable_policy_names()}
    features |= {f"decode {name}": [("/generate", body(context + question, 8, decode={"step": name}))]
                 for name in sorted(DECODE_STEPS)}
    child = parent_and_child(policy="keydiff", keep_fraction=0.5)
    features["child with a decode step"] = child[:1] + [("/generate", body(
        context + question, 8, policy="keydiff", keep_fraction=0.5, decode={"step": "streamingllm", "sinks": 4, "window": 16}))]
    features["plain request"] = [("/generate", body(context + question))]
    features["tenant"] = parent_and_child(tenant="matrix-tenant")
    features["allocation pyramidkv"] = parent_and_child(policy="snapkv", keep_fraction=0.5, allocation="pyramidkv")
    features["protected prefix"] = parent_and_child(policy="knorm", keep_fraction=0.3, protected_prefix_len=8)
    for where, start in (("inside the context", 4), ("past the context", len(context) + 2)):
        judged = body(context + question, policy="keydiff", keep_fraction=0.5)
        judged.update(return_logprob=True, logprob_start_len=start)
        features[f"child logprobs from {where}"] = child[:1] + [("/generate", judged)]
    sampled = body(context + question)
    sampled["sampling_params"]["n"] = 2
    features["n = 2"] = [("/generate", sampled)]
    streamed = body(context + question)
    streamed["stream"] = True
    features["stream"] = [("/generate", streamed)]
    features["OpenAI completions"] = [("/v1/completions", {
        "model": "default", "prompt": context + question, "max_tokens": 6, "temperature": 0,
        "custom_params": {"kvx": {"policy": "keydiff", "keep_fraction": 0.5}}})]
    features["OpenAI chat"] = [("/v1/chat/completions", {
        "model": "default", "messages": [{"role": "user", "content": text(60, seed=502)}], "max_tokens": 6,
        "temperature": 0, "custom_params": {"kvx": {"policy": "keydiff", "keep_fraction": 0.5}}})]
    return features


def _send(url: str, route: str, payload: dict) -> tuple[int, object]:
    response = requests.post(url + route, json=payload, timeout=TIMEOUT, stream=bool(payload.get("stream")))
    if response.status_code != 200:
        return response.status_code, response.text[:300]
    if payload.get("stream"):
        chunks = [line[len(b"data: "):] for line in response.iter_lines() if line.startswith(b"data: ")]
        return 200, json.loads(chunks[-2])["output_ids"]  # the last chunk before [DONE]
    answer = response.json()
    if route == "/generate":
        return 200, [a["output_ids"] for a in answer] if isinstance(answer, list) else answer["output_ids"]
    return 200, [choice.get("text") or choice["message"]["content"] for choice in answer["choices"]]


def _noise(ref, i: int) -> dict:
    return {"input_ids": ref.encode(text(30 + 25 * i, seed=600 + i)),
            "sampling_params": {**GREEDY, "max_new_tokens": 12 + i}}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_feature_is_served_alike_alone_and_mixed_or_refused_by_name(mode, shared_server, server_pool, references,
                                                                         demo_paths) -> None:
    check_matrix(mode, *_server(mode, shared_server, server_pool, references, demo_paths))


def check_matrix(mode: str, server, ref) -> None:
    """Every feature on ``server``: served alike alone and in a concurrent batch, or refused by name."""
    matrix: dict[str, str] = {}
    problems = []
    for name, sends in _features(ref).items():
        server.flush()
        for route, payload in sends:
            status, alone = _send(server.url, route, payload)
        if status == 200:
            # The judged request again, beside three others of other lengths, after the same setup.
            server.flush()
            for route, payload in sends[:-1]:
                _send(server.url, route, payload)
            route, payload = sends[-1]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                noise = [pool.submit(_send, server.url, "/generate", _noise(ref, i)) for i in range(3)]
                mixed_status, mixed = pool.submit(_send, server.url, route, payload).result()
                assert all(f.result()[0] == 200 for f in noise)
            matrix[name] = "served"
            if (mixed_status, mixed) != (200, alone):
                problems.append(f"{name}: alone {alone}, in a concurrent batch {mixed_status} {mixed}")
        elif 400 <= status < 500 and ("custom_params.kvx" in alone or "sglang_kvx" in alone):
            matrix[name] = "refused"
        elif 400 <= status < 500 and "chat_template" in alone:
            matrix[name] = "refused by SGLang"  # the checkpoint has no chat template: plain SGLang's own 400
        else:
            matrix[name] = f"{status}"
            problems.append(f"{name}: {status} {alone}")
    served = sum(v == "served" for v in matrix.values())
    print(f"[matrix] {mode}: {served} served, {sum(v == 'refused' for v in matrix.values())} refused of {len(matrix)}: "
          + json.dumps(matrix))
    assert not problems, f"{mode} server:\n" + "\n".join(problems) + "\n" + json.dumps(matrix, indent=1)
    assert served >= 3, matrix  # at least plain requests, n = 2 and streaming are served everywhere
