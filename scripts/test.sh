#!/usr/bin/env bash
# Set up, then run the test suite: real SGLang servers on loopback, shared across the suite.
#   bash scripts/test.sh           the whole suite, what CI runs first (10:55 on 2 cores, 2026-12-08)
#   bash scripts/test.sh --quick   unit tests and the shared dense server only: the inner loop (about 5 min)
#   bash scripts/test.sh --long    the long-scale runs (marked `long`), which CI runs after the suite
# Any further arguments go to pytest (a file, -k EXPR, -x, ...). The whole suite runs on two
# pytest-xdist workers, each with its own pool of servers (KVX_TEST_WORKERS=0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not long")
# --dist loadfile with tests/file_order.py's groups; --no-loadscope-reorder keeps its longest-first order.
workers=(-n "${KVX_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
case "${1:-}" in
  --quick) tier=(-m "(not slow or quick) and not long"); workers=(); shift ;;
  --long) tier=(-m "long"); workers=(); shift ;;
esac
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
# --durations: a CI log that runs long names its slowest tests; the suite's last lines give its
# wall time and every server start (tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${workers[@]}" "${tier[@]}" "$@"
