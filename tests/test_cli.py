"""Bad flags on SGLang's own launcher: one clear line naming the valid choices, before any model loads.

Most refusals are checked through SGLang's own launch-time parsing in one worker process
(``launch_parser``, conftest); real launches (``launch``, marked ``fresh_process``) prove the hooks
are wired into ``python -m sglang.launch_server`` itself and refuse before the model loads.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_kvx.serve.launcher import server_env


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        capture_output=True, text=True, timeout=300, env=server_env(),
    )


def our_error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("sglang-kvx: error:")]


@pytest.mark.parametrize(
    "flags,expected",
    [
        (("--kvx-policy", "bogus"), "unknown --kvx-policy 'bogus'; valid choices: gatesight, h2o, keydiff, knorm, kvzap, kvzap_linear, kvzip, kvzip_plus, none, pyramidkv, random, "
         "snapkv, streamingllm, triattention"),
        (("--kvx-keep-fraction", "0"), "--kvx-keep-fraction must be a number in (0, 1], got 0.0"),
        (("--kvx-keep-fraction", "1.5"), "--kvx-keep-fraction must be a number in (0, 1], got 1.5"),
        (("--kvx-keep-fraction", "half"), "--kvx-keep-fraction must be a number in (0, 1], got 'half'"),
        (("--kvx-policy", "gatesight"), "--kvx-policy gatesight needs gdn, output_gate, which LlamaForCausalLM does not provide"),
        (("--kvx-decode", "keydiff"), "--kvx-decode keydiff needs decode_attention_weights, which LlamaForCausalLM does not "
         "provide (serve a dense cell of the learned-gate family: weights/gated/*-none)"),
    ],
)
def test_bad_flags_fail_fast_with_one_line(launch_parser, demo_paths, flags, expected):
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [f"sglang-kvx: error: {expected}"]


@pytest.mark.slow
@pytest.mark.fresh_process
def test_the_real_launcher_refuses_before_the_model_loads(demo_paths):
    result = launch("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024", "--kvx-keep-fraction", "0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == ["sglang-kvx: error: --kvx-keep-fraction must be a number in (0, 1], got 0.0"]
    assert "Load weight" not in result.stdout + result.stderr  # refused before the model loads


def test_the_parser_accepts_what_the_launcher_would_start(launch_parser, demo_paths):
    """The in-process parse can fail: good flags are not refused (exit 0, no error line)."""
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024",
                                 "--kvx-policy", "keydiff", "--kvx-keep-fraction", "0.3")
    assert result.returncode == 0 and our_error_lines(result.stderr) == [], result.stderr[-2000:]


def test_on_off_flags_take_sglangs_store_true_form_too(launch_parser, demo_paths, tmp_path):
    """SGLang's booleans are flags given alone (store_true): ours are too, and 'on' / 'off' still work."""
    from sglang_kvx.config import add_cli_args, build_config
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--kvx-decode-steps", "--kvx-persist-contexts", "--kvx-context-dir", str(tmp_path / "d")])
    config = build_config("knorm", 0.5, decode_steps=args.kvx_decode_steps, persist_contexts=args.kvx_persist_contexts,
                          context_dir=args.kvx_context_dir)
    assert config.decode_steps is True and config.persist_contexts is True
    assert parser.parse_args(["--kvx-decode-steps", "off"]).kvx_decode_steps == "off"
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024",
                                 "--kvx-decode-steps", "--kvx-policy", "keydiff")
    assert result.returncode == 0 and our_error_lines(result.stderr) == [], result.stderr[-2000:]
    # The help's list of decode steps is the registry's, read when the help is built.
    from sglang_kvx.decode import decode_step_names

    help_text = parser.format_help().replace("\n", " ")
    assert all(name in help_text for name in decode_step_names()), help_text


def test_missing_model_path_is_a_clear_error(launch_parser):
    result = launch_parser.parse("--model-path", "/nonexistent/model", "--max-total-tokens", "1024")
    assert result.returncode == 2
    assert our_error_lines(result.stderr) == ["sglang-kvx: error: --model-path /nonexistent/model does not exist"]


@pytest.mark.slow
@pytest.mark.fresh_process
def test_launcher_help_lists_the_kvx_flags():
    result = launch("--help")
    assert result.returncode == 0
    assert "--kvx-policy" in result.stdout and "--kvx-keep-fraction" in result.stdout


GATED = "weights/gated"


def _gated(cell: str) -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1] / GATED / cell)


@pytest.mark.parametrize(
    "cell,flags,expected",
    [
        ("sigmoid-rope-none", ("--kvx-decode", "sigmoid-gate"),
         "--kvx-decode sigmoid-gate needs learned_gates, which KvxGatedForCausalLM does not provide "
         "(serve a gated checkpoint: weights/gated/*-gate)"),
        ("sigmoid-rope-gate", ("--kvx-decode", "h2o"),
         "--kvx-decode h2o needs decode_attention_weights, which KvxGatedForCausalLM does not provide "
         "(serve a dense cell of the learned-gate family: weights/gated/*-none)"),
        ("softmax-nope-none", ("--kvx-decode", '{"step": "h2o", "budget": 1}'),
         "--kvx-decode: budget must be >= 2 (a recent half and a heavy half), got 1"),
        ("sigmoid-rope-gate", ("--kvx-decode", '{"step": "sigmoid-gate", "tau": 1.5}'),
         "--kvx-decode: tau must be in [0, 1), got 1.5"),
        ("sigmoid-rope-gate", ("--attention-backend", "torch_native", "--kvx-decode", "sigmoid-gate"),
         "KvxGatedForCausalLM (sigmoid attention with learned gates) needs --attention-backend kvx_gated "
         "(the default for it); got 'torch_native'"),
        ("sigmoid-rope-gate", ("--kvx-policy", "snapkv"),
         "--kvx-policy snapkv needs attention, keys, which KvxGatedForCausalLM does not provide"),
    ],
)
def test_gated_models_refuse_what_they_cannot_serve(launch_parser, cell, flags, expected):
    result = launch_parser.parse("--model-path", _gated(cell), "--max-total-tokens", "1024", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [f"sglang-kvx: error: {expected}"]


def test_the_gated_backend_refuses_other_models(launch_parser, demo_paths):
    result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024", "--attention-backend", "kvx_gated")
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [
        "sglang-kvx: error: --attention-backend kvx_gated serves only the learned-gate family (kvx_gated_gpt); "
        "LlamaForCausalLM is not one"]


def test_a_gate_step_without_a_frozen_threshold_is_refused(launch_parser, tmp_path):
    import json
    import shutil

    model = tmp_path / "unfrozen"
    shutil.copytree(_gated("sigmoid-rope-gate"), model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["tau"] = None
    (model / "manifest.json").write_text(json.dumps(manifest))
    result = launch_parser.parse("--model-path", str(model), "--max-total-tokens", "1024", "--kvx-decode", "sigmoid-gate")
    assert result.returncode == 2, result.stderr[-2000:]
    assert our_error_lines(result.stderr) == [
        "sglang-kvx: error: --kvx-decode sigmoid-gate needs a threshold: the checkpoint's manifest.json has no tau; "
        "pass --kvx-decode '{\"step\": \"sigmoid-gate\", \"tau\": 0.05}'"]


# Hostile values for every flag of the schema: empty, negative, huge, not a number, not finite,
# broken JSON, a relative module name, whitespace, a long string.
HOSTILE_VALUES = ("", "-1", "abc", "1e309", "nan", "99999999999999999999999", "{", "..x", " ", "x" * 5000)


def test_every_flag_takes_hostile_values_with_one_line_or_starts(launch_parser, demo_paths):
    """Generated from ``schema.FLAG_SETTINGS``: each flag with each hostile value is either accepted
    (the launch would go on) or refused with exit 2 and one ``sglang-kvx: error:`` line; never a
    traceback, never a value echoed back at length."""
    from sglang_kvx.schema import FLAG_SETTINGS

    outcomes = {}
    for setting in FLAG_SETTINGS:
        for value in HOSTILE_VALUES:
            result = launch_parser.parse("--model-path", demo_paths["tiny-llama"], "--max-total-tokens", "1024",
                                         setting.flag, value)
            lines = our_error_lines(result.stderr)
            where = f"{setting.flag} {value[:20]!r}: exit {result.returncode}: {result.stderr[-600:]}"
            assert "Traceback" not in result.stderr, where
            assert result.returncode in (0, 2), where
            if result.returncode == 2:
                assert len(lines) == 1 and len(lines[0]) < 400, where
            outcomes[setting.flag, value] = result.returncode
    # What must be refused is refused (not merely not crashing).
    for flag in ("--kvx-keep-fraction", "--kvx-min-store-fraction", "--kvx-protected-prefix-len",
                 "--kvx-sparse-attention", "--kvx-auto-context-min-tokens", "--kvx-decode-steps", "--kvx-host-store-gb"):
        for value in ("-1", "abc", "1e309", "nan", "99999999999999999999999"):
            assert outcomes[flag, value] == 2, (flag, value)
    assert outcomes["--kvx-policy-modules", "..x"] == 2
    assert outcomes["--kvx-decode", "{"] == 2


def test_the_engine_takes_every_flag_as_a_keyword():
    """``Engine``'s keywords are the schema's flags: an unknown ``kvx_`` keyword is refused by name."""
    from sglang_kvx.adapter.engine import Engine

    with pytest.raises(TypeError, match="unknown keyword 'kvx_keep_fractoin'"):
        Engine(model_path="unused", kvx_keep_fractoin=0.5)
