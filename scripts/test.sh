#!/usr/bin/env bash
# Set up, then run the whole test suite (real SGLang servers on loopback; over an hour on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
# --durations: a CI log that runs long names its slowest tests.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" tests
