"""In-process serving with the extension's settings (``sglang_kvx.adapter.engine``)."""

from sglang_kvx.adapter.engine import Engine

__all__ = ["Engine"]
