"""Request settings: strict field types, one frozen settings object, door checks, real checkpoint configs."""

from __future__ import annotations

import json

import pytest

from sglang_kvx.adapter.door import door_problem
from sglang_kvx.config import traits_of_config
from sglang_kvx.settings import (
    CompactionSettings,
    RequestFields,
    ServerDefaults,
    SettingsError,
    parse_request_fields,
    resolve_settings,
)

DENSE = ServerDefaults("knorm", 0.5, 0, frozenset({"keys", "values", "attention", "queries", "reconstruction"}))


@pytest.mark.parametrize("raw,fragment", [
    ({"policy": ["snapkv"]}, "policy must be a string"),
    ({"policy": {"name": "snapkv"}}, "policy must be a string"),
    ({"policy": "x" * 10_000}, "a string of 10000 characters"),
    ({"keep_fraction": "0.5"}, "keep_fraction must be a number in (0, 1]"),
    ({"keep_fraction": True}, "keep_fraction must be a number"),
    ({"keep_fraction": 1.5}, "(0, 1]"),
    ({"keep_fraction": float("nan")}, "(0, 1]"),
    ({"protected_prefix_len": 1.5}, "whole number"),
    ({"protected_prefix_len": -1}, "whole number"),
    ({"protected_prefix_len": False}, "whole number"),
    ({"compact": "false"}, "compact must be true or false"),
    ({"compact": 0}, "compact must be true or false"),
    ({"allocation": "pyramid"}, "valid choices"),
    ({"polcy": "snapkv"}, "unknown field 'polcy'"),
    ({"tenant": ""}, "tenant must be a string of 1 to 64"),
    ({"tenant": "a" * 65}, "tenant must be a string"),
    ({"tenant": "a b"}, "tenant must be a string"),
    ({"tenant": 7}, "tenant must be a string"),
    ({"tenant": ["team-a"]}, "tenant must be a string"),
    ([1, 2, 3], "must be a JSON object"),
    ("snapkv", "must be a JSON object"),
])
def test_bad_fields_are_refused_naming_the_field(raw, fragment):
    with pytest.raises(SettingsError) as err:
        parse_request_fields(raw)
    message = str(err.value)
    assert fragment in message and message.startswith("custom_params.kvx")
    assert len(message) < 400  # never echoes a large value


def test_good_fields_parse_once_into_frozen_settings():
    fields = parse_request_fields({"policy": "snapkv", "keep_fraction": 1, "protected_prefix_len": 4, "compact": True,
                                   "tenant": "team-a.prod:1"})
    assert fields == RequestFields(policy="snapkv", keep_fraction=1.0, protected_prefix_len=4, compact=True,
                                   tenant="team-a.prod:1")
    settings = resolve_settings(fields, DENSE)
    assert settings == CompactionSettings("snapkv", 1.0, 4, "flat")
    with pytest.raises(AttributeError):
        settings.policy = "knorm"  # frozen: safe as the store's key
    assert hash(settings) == hash(CompactionSettings("snapkv", 1.0, 4, "flat"))
    # Unsent fields take the server's flags; the policy's own allocation applies unless named.
    assert resolve_settings(parse_request_fields(None), DENSE) == CompactionSettings("knorm", 0.5, 0, "flat")
    assert resolve_settings(parse_request_fields({"policy": "pyramidkv"}), DENSE).allocation == "pyramidkv"


def test_resolution_checks_the_model_and_parallelism():
    with pytest.raises(SettingsError, match="needs gdn, output_gate"):
        resolve_settings(parse_request_fields({"policy": "gatesight"}), DENSE)
    with pytest.raises(SettingsError, match="allocation 'gate' needs output_gate"):
        resolve_settings(parse_request_fields({"allocation": "gate"}), DENSE)
    tp = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals, tp_size=2)
    # Every served policy and allocation but 'global' is rank-consistent (signals.gather_heads); a policy
    # declaring otherwise is refused (tests/test_parallel.py, with a throwaway one). KVzip's own
    # allocation is one threshold over every KV head, which a rank cannot see: flat under TP.
    with pytest.raises(SettingsError, match="allocation 'global' is not supported with --tp-size 2 yet"):
        resolve_settings(parse_request_fields({"policy": "kvzip"}), tp)
    assert resolve_settings(parse_request_fields({"policy": "kvzip", "allocation": "flat"}), tp).policy == "kvzip"
    assert resolve_settings(parse_request_fields({"policy": "snapkv", "allocation": "gate"}),
                            ServerDefaults("knorm", 0.5, 0, DENSE.model_signals | {"gdn", "output_gate"}, tp_size=2)).allocation == "gate"
    paged = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals, page_size=16)
    with pytest.raises(SettingsError, match="not supported with --page-size 16"):
        resolve_settings(parse_request_fields({"policy": "kvzip"}), paged)
    assert resolve_settings(parse_request_fields({"policy": "pyramidkv"}), paged).policy == "pyramidkv"
    mla = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals, per_layer_lengths=False)
    with pytest.raises(SettingsError, match="per-layer lengths"):
        resolve_settings(parse_request_fields({"policy": "pyramidkv"}), mla)
    plain = ServerDefaults("none", 1.0, 0, DENSE.model_signals)
    with pytest.raises(SettingsError, match="policy is needed"):
        resolve_settings(parse_request_fields({"keep_fraction": 0.5}), plain)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"rid": "kvx-internal-kvzip-pass-0-0"}, "rid must not start with"),
    ({"rid": ["a", "kvx-internal-x"]}, "rid must not start with"),
    ({"sampling_params": {"custom_params": {"kvx": {"policy": ["snapkv"]}}}}, "custom_params.kvx.policy"),
    ({"input_ids": [1, 2, 99]}, "input_ids must lie in [0, 99)"),
    ({"input_ids": [1, -1]}, "got -1"),
    ({"input_ids": [1, 2**63 - 1]}, "19-digit number"),
    ({"input_ids": []}, "the prompt is empty"),
    ({"input_ids": [], "sampling_params": {"max_new_tokens": 5}}, "the prompt is empty"),
])
def test_the_door_refuses_what_would_reach_the_scheduler_broken(kwargs, fragment):
    args = {"rid": None, "sampling_params": {}, "input_ids": [1, 2, 3], "vocab_size": 99, "generates": True, **kwargs}
    problem = door_problem(**args)
    assert problem is not None and fragment in problem, problem


def test_the_door_refuses_kv_fields_a_server_without_the_extension_would_ignore():
    plain = dict(rid=None, input_ids=[1, 2], vocab_size=99, generates=True, extension_active=False)
    problem = door_problem(sampling_params={"custom_params": {"kvx": {"decode": {"step": "h2o", "budget": 8}}}}, **plain)
    assert problem.startswith("custom_params.kvx.decode: this server runs without the KV extension")
    assert "keep_fraction" in door_problem(sampling_params={"custom_params": {"kvx": {"keep_fraction": 0.5}}}, **plain)
    assert door_problem(sampling_params={"custom_params": {"kvx": {"compact": False, "tenant": "a"}}}, **plain) is None


def test_the_door_lets_good_requests_through():
    assert door_problem(rid="mine", sampling_params={"custom_params": {"kvx": {"policy": "knorm"}}},
                        input_ids=[0, 98], vocab_size=99, generates=True) is None
    # SGLang's own custom_params, and an empty prefill-only prompt, are not ours to refuse.
    assert door_problem(rid=None, sampling_params={"custom_params": {"other": [1]}, "max_new_tokens": 0},
                        input_ids=[], vocab_size=99, generates=True) is None


def _hybrid(n_layers: int, **fields) -> dict:
    return {"model_type": "qwen3_next", "num_hidden_layers": n_layers, "num_attention_heads": 16,
            "num_key_value_heads": 2, **fields}


def test_layer_ids_from_published_config_forms():
    # Qwen3-Next: no layer_types, every 4th layer attends.
    traits = traits_of_config({"architectures": ["Qwen3NextForCausalLM"], **_hybrid(8, full_attention_interval=4)})
    assert traits.attention_layer_ids == (3, 7) and traits.gdn_layer_ids == (0, 1, 2, 4, 5, 6)
    assert traits.has_gdn and traits.has_output_gate and traits.num_attention_layers == 2
    # Qwen3.5: a multimodal config nesting the language model's, with explicit layer_types.
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "vision_config": {"depth": 2},
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "layer_types": kinds,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "full_attention_interval": 4}}
    traits = traits_of_config(nested)
    assert traits.attention_layer_ids == (3, 7) and traits.num_kv_heads == 2 and traits.has_output_gate
    assert traits.architecture == "Qwen3_5ForConditionalGeneration"
    # A dense model attends in every layer, whatever else its config says.
    dense = traits_of_config({"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 4})
    assert dense.attention_layer_ids == (0, 1, 2) and not dense.has_gdn and dense.num_kv_heads == 4


def test_the_new_flags_are_validated_before_anything_loads():
    from sglang_kvx.config import KvxConfigError, build_config

    with pytest.raises(KvxConfigError, match="--kvx-decode-steps must be 'on' or 'off'"):
        build_config("none", decode_steps="yes")
    with pytest.raises(KvxConfigError, match="--kvx-policy-modules: cannot import 'no_such_module_kvx'"):
        build_config("none", policy_modules="no_such_module_kvx")
    for bad in ("1", "-0.1", "half"):
        with pytest.raises(KvxConfigError, match="--kvx-min-store-fraction must be"):
            build_config("none", min_store_fraction=bad)
    assert build_config("knorm", min_store_fraction="0.5").min_store_fraction == 0.5
    assert build_config("none", decode_steps="on").enabled  # decode steps alone switch the extension on
    assert not build_config("none").enabled


def test_decode_settings_are_typed_and_built_once():
    from sglang_kvx.decode import DecodeSettings

    fields = parse_request_fields({"decode": {"step": "streamingllm", "sinks": 2, "window": 8}})
    assert fields.decode == DecodeSettings("streamingllm", (("sinks", 2), ("window", 8)))
    step = fields.decode.build()
    assert step.span(1).hidden(20) == (2, 12) and step.live_tokens(30) == 39
    with pytest.raises(SettingsError, match="custom_params.kvx.decode.window must be a whole number"):
        parse_request_fields({"decode": {"step": "streamingllm", "window": 2.5}})
    with pytest.raises(SettingsError, match="window and full_every must be >= 1"):
        parse_request_fields({"decode": {"step": "span_schedule", "window": 0}})


def test_routed_decode_steps_take_real_options_and_merge_over_the_servers():
    from sglang_kvx.decode import FULL, DecodeSettings, parse_decode_settings
    from sglang_kvx.settings import resolve_decode

    oda = parse_request_fields({"decode": {"step": "oda", "theta": 0.25, "window": 32}}).decode
    assert oda == DecodeSettings("oda", (("window", 32), ("theta", 0.25)))
    step = oda.build()
    assert step.forward_outputs == {"final_hidden", "input_embeddings"} and step.span(1).hidden(100) == (4, 68)
    # Eq. 4: Full iff the score exceeds theta; a score that is not finite falls back to Full.
    assert step.rerun_span(1, step.span(1), 0.2) is None
    assert step.rerun_span(2, step.span(2), 0.3) is FULL
    assert step.rerun_span(3, step.span(3), float("nan")) is FULL and step.schedule == [False, True, True]
    for bad in ("0.5", True, float("inf"), 1e7, [0.5]):
        with pytest.raises(SettingsError, match="theta must be a finite number"):
            parse_request_fields({"decode": {"step": "oda", "theta": bad}})
    # A request naming the server's step overrides single options; another step replaces it.
    server = ServerDefaults("none", 1.0, 0, frozenset(), decode=parse_decode_settings({"step": "oda", "window": 64, "theta": 0.5}))
    assert dict(resolve_decode(parse_request_fields({"decode": {"step": "oda", "theta": 1}}), server).options) == {"window": 64, "theta": 1.0}
    assert resolve_decode(parse_request_fields(None), server) == server.decode
    assert resolve_decode(parse_request_fields({"decode": {"step": "streamingllm"}}), server).step == "streamingllm"
    # With pages no step runs (the launcher refuses --kvx-decode there; a request's own step is refused too).
    paged = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals, page_size=16)
    assert resolve_decode(parse_request_fields(None), paged) is None
    with pytest.raises(SettingsError, match=r"custom_params.kvx.decode: .*--page-size 16"):
        resolve_decode(parse_request_fields({"decode": {"step": "streamingllm"}}), paged)
    sparse = ServerDefaults("none", 1.0, 0, DENSE.model_signals, sparse_budget=32)
    with pytest.raises(SettingsError, match=r"custom_params.kvx.decode: .*--kvx-sparse-attention"):
        resolve_decode(parse_request_fields({"decode": {"step": "span_schedule"}}), sparse)
    # Without --kvx-decode-steps on (or a --kvx-decode step) a request's own step is refused, as the README says.
    off = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals)
    with pytest.raises(SettingsError, match=r"custom_params.kvx.decode: this server runs without decode-time steps"):
        resolve_decode(parse_request_fields({"decode": {"step": "streamingllm"}}), off)
    on = ServerDefaults("knorm", 0.5, 0, DENSE.model_signals, decode_steps=True)
    assert resolve_decode(parse_request_fields({"decode": {"step": "streamingllm"}}), on).step == "streamingllm"
    # Chance routing at a rate: repeatable, about the rate over many steps.
    chance = parse_decode_settings({"step": "random_route", "rate": 0.25, "seed": 3}).build()
    picks = [chance.rerun_span(t, chance.span(t)) is not None for t in range(1, 2001)]
    assert picks == [chance.rerun_span(t, chance.span(t)) is not None for t in range(1, 2001)]
    assert 0.2 < sum(picks) / len(picks) < 0.3


def test_a_new_setting_is_one_entry_in_the_schema():
    """Issue #55 item 5, shown: one ``Setting`` appended to ``schema.SETTINGS`` (and nothing else) gives the
    launcher flag with its help and both spellings of a switch, a bad value refused naming the flag, the
    typed value on the server config and on the scheduler's ``ServerDefaults``, the request field parsed
    by the same kind, and its row in the docs' flags table. Run in a fresh interpreter: the derived
    tables are built when the modules load."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import argparse, json
        from sglang_kvx import schema
        new = schema.Setting("demo_switch", "a switch nothing reads (this test's)", schema.Switch(), default="off",
                             field_too=True)
        schema.SETTINGS = (*schema.SETTINGS, new)
        schema.FLAG_SETTINGS = (*schema.FLAG_SETTINGS, new)
        schema.FIELD_SETTINGS = (*schema.FIELD_SETTINGS, new)
        from sglang_kvx import config, settings
        parser = argparse.ArgumentParser()
        config.add_cli_args(parser)
        bare, spelled = parser.parse_args(["--kvx-demo-switch"]), parser.parse_args(["--kvx-demo-switch", "off"])
        built = config.build_config("knorm", "0.5", demo_switch=bare.kvx_demo_switch)
        try:
            config.build_config("knorm", "0.5", demo_switch="maybe")
            refused = ""
        except config.KvxConfigError as exc:
            refused = str(exc)
        defaults = settings.ServerDefaults.of(built, model_signals=frozenset())
        fields = settings.parse_request_fields({"demo_switch": True})
        print(json.dumps({"help": parser.format_help().count("--kvx-demo-switch"), "config": built.demo_switch,
                          "spelled": config.build_config("knorm", "0.5", demo_switch=spelled.kvx_demo_switch).demo_switch,
                          "refused": refused, "defaults": defaults.demo_switch, "field": fields.demo_switch,
                          "table": "--kvx-demo-switch" in schema.flags_table()}))
    ''')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["help"] >= 1 and got["config"] is True and got["spelled"] is False and got["defaults"] is True
    assert "--kvx-demo-switch" in got["refused"] and got["field"] is True and got["table"], got
