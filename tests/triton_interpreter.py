"""Run a test file of Triton kernel checks in a process of its own under Triton's interpreter, on the CPU.

TRITON_INTERPRET must be set before triton is imported, so the file runs in a subprocess whose path has the folder
`make venv` installs triton into on a CPU machine (``.venv/triton-interpreter``: outside the venv's site-packages,
so no other process of the suite imports triton; Makefile).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRITON_FOLDER = Path(sys.prefix) / "triton-interpreter"

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None and not TRITON_FOLDER.is_dir(),
                                  reason="no triton: `make venv` installs it into .venv/triton-interpreter")


def assert_passes_interpreted(test_file: Path, timeout: float) -> None:
    """``pytest test_file`` under the interpreter: exit code 0, tests passed and none skipped."""
    path = os.pathsep.join(p for p in (str(TRITON_FOLDER), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
