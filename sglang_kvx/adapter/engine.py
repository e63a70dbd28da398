"""In-process serving: ``sglang.Engine`` with the extension's settings.

``sglang.Engine(**kwargs)`` builds ``ServerArgs`` from keyword arguments, and
ServerArgs has no ``kvx_*`` fields; this helper validates them the same way
the launcher flags are validated and hands SGLang a ready ServerArgs.
"""

from __future__ import annotations

from typing import Any


def Engine(
    *,
    kvx_policy: str = "none",
    kvx_keep_fraction: float | str = 1.0,
    kvx_protected_prefix_len: int | str = 0,
    kvx_estimator: str = "",
    **kwargs: Any,
):
    """``sglang.Engine`` with the ``--kvx-*`` flags given as keywords."""
    import sglang
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_kvx.config import build_config
    from sglang_kvx.adapter.server_config import attach_config

    load_plugins()  # hooks must be in place before ServerArgs is built
    config = build_config(kvx_policy, kvx_keep_fraction, kwargs.get("model_path"), kvx_protected_prefix_len, kvx_estimator,
                          tp_size=int(kwargs.get("tp_size") or 1), page_size=int(kwargs.get("page_size") or 1))
    kwargs.setdefault("log_level", "error")
    server_args = ServerArgs(**kwargs)
    attach_config(server_args, config)
    return sglang.Engine(server_args=server_args)
