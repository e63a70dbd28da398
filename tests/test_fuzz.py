"""Fuzzing ``custom_params.kvx`` and the decode options with hypothesis (issue #41 item 6).

Two layers, each with a fixed budget of examples and a fixed seed (``derandomize``), so a run is
repeatable and its cost bounded:

- the door's parsing and the scheduler's resolution, pure: any JSON value is either parsed into
  settings or refused with one short ``SettingsError`` line, never another exception, whatever the
  server's facts (TP, pages, sparse attention, the model's signals, decode steps on or off);
- the shared compacting hybrid server: each drawn ``custom_params.kvx`` sent as a parent and as a
  child is answered 200 or 4xx (never 5xx, never a hang), and every ten examples the server is
  alive, a known child's answer is unchanged and the pool balances.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_kvx.decode import DECODE_STEPS
from sglang_kvx.policies import servable_policy_names
from sglang_kvx.schema import FIELD_SETTINGS
from sglang_kvx.settings import ServerDefaults, SettingsError, parse_request_fields, resolve_decode, resolve_settings

from test_compaction_e2e import GREEDY, kvx, text, wait_idle

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=80))
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)
OPTION_NAMES = sorted({name for cls in DECODE_STEPS.values() for name in cls.options + cls.real_options})
NUMBERS = st.one_of(st.integers(min_value=-10, max_value=2**26), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, 4, 8, 64, 0.05, 0.5, 1e6, "8", True]))
DECODE = st.one_of(st.none(), ANY_JSON, st.builds(
    lambda step, options: {"step": step, **options},
    st.sampled_from(sorted(DECODE_STEPS) + ["nope", 3]),
    st.dictionaries(st.sampled_from(OPTION_NAMES + ["bogus"]), NUMBERS, max_size=3)))
KVX_FIELDS = st.fixed_dictionaries({}, optional={
    "policy": st.one_of(st.sampled_from(servable_policy_names() + ["bogus", ""]), ANY_JSON),
    "keep_fraction": st.one_of(NUMBERS, ANY_JSON),
    "protected_prefix_len": st.one_of(st.integers(min_value=-5, max_value=2**40), ANY_JSON),
    "allocation": st.one_of(st.sampled_from(["flat", "pyramid", "global", "gate", "bogus"]), ANY_JSON),
    "compact": st.one_of(st.booleans(), ANY_JSON),
    "decode": DECODE,
    "tenant": st.one_of(st.from_regex(r"[A-Za-z0-9._:@-]{1,64}", fullmatch=True), ANY_JSON),
    "unknown_field": ANY_JSON,
})
SIGNALS = frozenset({"keys", "values", "attention", "queries", "reconstruction", "gdn", "output_gate",
                     "learned_gates", "decode_attention_weights"})
SERVERS = st.builds(
    lambda policy, tp, page, sparse, signals, steps: ServerDefaults(
        policy, 0.5, 0, signals, tp_size=tp, page_size=page, sparse_budget=sparse, decode_steps=steps),
    st.sampled_from(["none", "knorm", "kvzip", "gatesight", "snapkv"]), st.sampled_from([1, 2]),
    st.sampled_from([1, 16]), st.sampled_from([0, 32]), st.frozensets(st.sampled_from(sorted(SIGNALS))),
    st.booleans())


def test_the_schema_fuzzes_every_request_field() -> None:
    assert {s.name for s in FIELD_SETTINGS} == set(KVX_FIELDS.wrapped_strategy.optional) - {"unknown_field"}


@settings(max_examples=400, deadline=None, derandomize=True)
@given(raw=st.one_of(ANY_JSON, KVX_FIELDS), server=SERVERS)
def test_any_json_is_parsed_or_refused_with_one_line(raw, server) -> None:
    try:
        fields = parse_request_fields(raw)
        resolve_decode(fields, server)
        resolve_settings(fields, server)
    except SettingsError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 600, message


@pytest.fixture
def fuzzed_server(compacting_hybrid):
    server, ref = compacting_hybrid
    context = ref.encode(text(120, seed=91))
    question = ref.encode(" which word?")
    parent = server.generate({"input_ids": context, "sampling_params": {"max_new_tokens": 0, **kvx("knorm", 0.5)}})
    assert parent.status_code == 200, parent.text
    child = {"input_ids": context + question, "sampling_params": {**GREEDY, "max_new_tokens": 6, **kvx("knorm", 0.5)}}
    known = server.generate(child).json()["output_ids"]
    return server, ref, child, known, {"sent": 0, "total": server.stats()["kv_pool_total_tokens"]}


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=KVX_FIELDS, prompt_seed=st.integers(min_value=0, max_value=50))
def test_the_server_answers_every_fuzzed_request_with_200_or_400(fuzzed_server, fields, prompt_seed) -> None:
    server, ref, child, known, count = fuzzed_server
    context = ref.encode(text(40 + prompt_seed, seed=prompt_seed))
    for ids, new_tokens in ((context, 0), (context + ref.encode(" and?"), 3)):
        body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": new_tokens,
                                                      "custom_params": {"kvx": fields}}}
        response = requests.post(server.url + "/generate", data=json.dumps(body, allow_nan=True),
                                 headers={"content-type": "application/json"}, timeout=120)
        assert response.status_code == 200 or 400 <= response.status_code < 500, (fields, response.status_code,
                                                                                  response.text[:300])
        count["sent"] += 1
    if count["sent"] % 20 == 0:
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
        assert server.generate(child).json()["output_ids"] == known, "a known child changed its answer"
        stats = wait_idle(server, count["total"])
        held = stats["kv_pool_free_tokens"] + stats["kv_pool_evictable_tokens"] + stats["store_slots"]
        assert held == count["total"], f"pool out of balance after {count['sent']} requests: {stats}"
