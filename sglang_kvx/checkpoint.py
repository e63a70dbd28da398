"""What a checkpoint's ``config.json`` holds, read without the rest of the package (imported by
``config.py`` and by the GateSight estimators, which ``config.py`` reaches through the policies)."""

from __future__ import annotations

from typing import Any


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: multimodal checkpoints (Qwen3.5) nest it as ``text_config``."""
    nested = cfg.get("text_config")
    return nested if isinstance(nested, dict) else cfg
