"""Python code run in a fresh process under the Triton interpreter (TRITON_INTERPRET=1 must be set
before triton is imported): how the kernels' tests compare them with their torch references on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreted_lines(code: str, timeout: float = 600) -> list[str]:
    """Run ``code`` from the repository root under the interpreter; its stdout lines (it must exit 0)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()
