"""SGLang's server-argument resolution as it runs on a CUDA machine, without one: an H100 (sm90), CUDA 13.0.

Run as a script (a fresh interpreter: what it patches must be in place before SGLang is imported); it
reads one JSON command line per stdin line and answers one JSON line: what ``ServerArgs.resolve_once``
resolved (attention backend, decode and prefill graph config, overlap, mamba radix-cache strategy, page
size) and each declaration the plugin made, or the error.

What the stand-in reproduces, exactly: every question SGLang's resolution asks of the machine --
``torch.cuda.is_available`` / ``device_count`` / ``get_device_capability`` / ``get_device_name`` /
``get_device_properties`` / ``mem_get_info``, ``torch.version.cuda``, and SGLang's own platform facts
(``runtime_context.override_platform``: ``is_cuda``, ``is_sm90``, the device capability and SM) -- answered
as an 80 GB H100 with CUDA 13.0 would, the platform SGLang then picks being its own ``CudaSRTPlatform``
(the plugin's CPU platform declines: ``SGLANG_KVX_CPU=0``). Nothing else: no kernel runs, no model loads
beyond its config (FlashInfer and sgl-kernel are whatever the installed wheels are).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from types import SimpleNamespace

H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "memory": 80 * 2**30, "cuda": "13.0", "sms": 132}


def stand_in(devices: int) -> None:
    """Make this process's torch and SGLang see ``devices`` H100s (before SGLang is imported)."""
    import torch

    props = SimpleNamespace(name=H100["name"], total_memory=H100["memory"], major=H100["capability"][0],
                            minor=H100["capability"][1], multi_processor_count=H100["sms"], is_integrated=False)
    torch.version.cuda = H100["cuda"]
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda.device_count = lambda: devices
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda device=None: H100["capability"]
    cuda.get_device_name = lambda device=None: H100["name"]
    cuda.get_device_properties = lambda device=None: props
    cuda.mem_get_info = lambda device=None: (H100["memory"] - 2**30, H100["memory"])
    os.environ["SGLANG_KVX_CPU"] = "0"  # the plugin's CPU platform declines; SGLang picks CUDA's
    # sgl-kernel's compiled ops need libcuda to load; resolution imports modules that import them but runs
    # none: a permissive stand-in module, as SGLang stubs Triton on Apple machines (sglang/_platform_stubs.py).
    from sglang._platform_stubs import _MockModule

    import importlib.machinery

    class KernelStandIns:  # sgl_kernel and its submodules, as SGLang's _TritonFinder serves triton.*
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "sgl_kernel" and not fullname.startswith("sgl_kernel."):
                return None
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

        def create_module(self, spec):
            return _MockModule(spec.name)

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, KernelStandIns())


def resolve(argv: list[str]) -> dict:
    """``python -m sglang.launch_server ARGV``'s resolution on the stand-in machine."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    with override_platform(is_cuda=True, is_sm90=True, is_sm100=False, is_sm100_or_sm110=False, is_sm110=False,
                           is_sm120=False, is_blackwell=False, is_hopper_with_cuda_12_3=True, is_hip=False,
                           device_capability=H100["capability"], device_sm=90):
        server_args = prepare_server_args(argv)
        server_args.resolve_once()
        view = resolved_view(server_args)
        graphs = view.cuda_graph_config
        return {
            "attention_backend": view.attention_backend,
            "decode_graph": str(graphs.decode.backend),
            "decode_graph_max_bs": graphs.decode.max_bs,
            "prefill_graph": str(graphs.prefill.backend),
            "prefill_graph_max_tokens": max(graphs.prefill.bs) if graphs.prefill.bs else None,
            "overlap": not view.disable_overlap_schedule,
            "mamba_radix_cache_strategy": view.mamba_radix_cache_strategy,
            "page_size": view.page_size,
            "device": view.device,
            "declared": [[source, sorted(fields)] for source, fields in server_args._resolved_overrides
                         if source.startswith("sglang_kvx")],
        }


def main() -> None:
    devices = int(os.environ.get("KVX_STANDIN_DEVICES", "2"))
    stand_in(devices)
    from sglang.srt.plugins import load_plugins

    with contextlib.redirect_stdout(sys.stderr):
        load_plugins()  # as launch_server does first
    lines = Lines()
    logging.getLogger("sglang_kvx").addHandler(lines)  # not the root: SGLang reconfigures that one
    for line in sys.stdin:
        lines.records.clear()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                answer = {"resolved": resolve(json.loads(line))}
        except BaseException as exc:  # noqa: BLE001 - the test reports what SGLang said
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answer["plugin_log"] = [text for text in lines.records if text.startswith("sglang_kvx:")]
        print(json.dumps(answer, default=str), flush=True)


class Lines(logging.Handler):
    """Every log line of one resolution (what the plugin said it turned off)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


if __name__ == "__main__":
    main()
