"""In-process serving: ``sglang.Engine`` with the extension's settings.

``sglang.Engine(**kwargs)`` builds ``ServerArgs`` from keyword arguments, and
ServerArgs has no ``kvx_*`` fields; this helper validates them the same way
the launcher flags are validated and hands SGLang a ready ServerArgs.
"""

from __future__ import annotations

from typing import Any


def Engine(**kwargs: Any):
    """``sglang.Engine`` with every ``--kvx-*`` flag given as a keyword (``kvx_keep_fraction=0.3``;
    ``schema.FLAG_SETTINGS``), validated as the launcher validates them; a bad one raises KvxConfigError."""
    import sglang
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from sglang_kvx.adapter.server_config import attach_config
    from sglang_kvx.config import build_config
    from sglang_kvx.schema import FLAG_SETTINGS

    known = {setting.dest: setting.name for setting in FLAG_SETTINGS}
    unknown = sorted(key for key in kwargs if key.startswith("kvx_") and key not in known)
    if unknown:
        raise TypeError(f"Engine: unknown keyword {unknown[0]!r}; the extension's are {', '.join(known)}")
    flags = {known[key]: kwargs.pop(key) for key in list(kwargs) if key in known}
    load_plugins()  # hooks must be in place before ServerArgs is built
    config = build_config(model_path=kwargs.get("model_path"), tp_size=int(kwargs.get("tp_size") or 1),
                          page_size=int(kwargs.get("page_size") or 1),
                          attention_backend=kwargs.get("attention_backend"), **flags)
    kwargs.setdefault("log_level", "error")
    server_args = ServerArgs(**kwargs)
    attach_config(server_args, config)
    return sglang.Engine(server_args=server_args)
