"""The compile cache across two real processes on the CPU: the first compiles and stores, the second, with an empty
local inductor cache, loads from the run store and compiles nothing (inductor's C++ backend; Triton is not covered)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO


def _child(model, root, out, inductor_dir) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile worker pool to start: the test's time is the compile
    done = subprocess.run([sys.executable, str(REPO / "tests" / "compile_cache_child.py"), str(model), str(root),
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_fresh_process_loads_the_stored_compiles(tiny_model_path, tmp_path):
    root = tmp_path / "store"
    first = _child(tiny_model_path, root, tmp_path / "first.json", tmp_path / "inductor-1")
    runs = first["warm_up_runs"]
    assert runs["compile_cache_loaded"] == 0 and runs["compile_cache_saved"] > 0, runs
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0  # it compiled
    (entry,) = (root / "project" / "run" / "compile-cache").iterdir()
    assert len(entry.stem) == 64 and entry.suffix == ".bin"

    second = _child(tiny_model_path, root, tmp_path / "second.json", tmp_path / "inductor-2")
    runs = second["warm_up_runs"]
    assert runs["compile_cache_loaded"] == first["warm_up_runs"]["compile_cache_saved"], runs
    assert runs["compile_cache_hits"] >= runs["compile_cache_loaded"] and runs["compile_cache_saved"] == 0, runs
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second["inductor"]  # every graph came from the store
