"""The extension's config as every SGLang process sees it, and which platform a process runs on."""

from __future__ import annotations

import logging
import os

from sglang_kvx.config import KvxConfig

logger = logging.getLogger(__name__)

# server_args carries the validated config to every process as bookkeeping
# (an underscore attribute: ServerArgs pickles those along with its fields).
CONFIG_ATTR = "_kvx_config"
BUILT_ATTR = "_kvx_config_built"  # (pid, KvxConfig): built once per process, not per request


def attach_config(server_args, config: KvxConfig) -> None:
    setattr(server_args, CONFIG_ATTR, config)  # the typed config itself: it pickles with server_args
    setattr(server_args, BUILT_ATTR, None)
    if config.policy != "none":
        logger.info("sglang_kvx: policy=%s keep_fraction=%g", config.policy, config.keep_fraction)


def config_of(server_args) -> KvxConfig:
    """The config a process was started with (``none`` when launched without our flags), built the
    first time a process asks (its policy modules imported there too) and kept on ``server_args``."""
    built = getattr(server_args, BUILT_ATTR, None)
    if built is not None and built[0] == os.getpid():  # server_args travels to child processes pickled
        return built[1]
    config = getattr(server_args, CONFIG_ATTR, None) or KvxConfig()
    if config.policy_modules:
        from sglang_kvx.config import import_policy_modules

        import_policy_modules(config.policy_modules)  # their policies, registered in this process too
    setattr(server_args, BUILT_ATTR, (os.getpid(), config))
    return config


def on_cpu_platform() -> bool:
    from sglang.srt.platforms import current_platform

    from sglang_kvx.adapter.platform import KvxCpuPlatform

    return isinstance(current_platform, KvxCpuPlatform)
