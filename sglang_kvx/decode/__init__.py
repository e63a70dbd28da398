"""Decode-time steps (see ``base.py``); importing a step's module registers it."""

from sglang_kvx.decode.base import (
    DECODE_STEPS,
    FULL,
    DecodeSettings,
    DecodeStep,
    Span,
    decode_step_names,
    parse_decode_settings,
    register_decode_step,
)
from sglang_kvx.decode import h2o, keydiff, oda, random_route, schedule, sigmoid_gate, streaming  # noqa: F401,E402
from sglang_kvx.decode import kvzap  # noqa: F401,E402

__all__ = ["DECODE_STEPS", "FULL", "DecodeSettings", "DecodeStep", "Span", "decode_step_names",
           "parse_decode_settings", "register_decode_step"]
