#!/usr/bin/env bash
# Set up, then run the main job: serve the embedded demo model, one shared context, several questions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/sglang-kvx demo "$@"
