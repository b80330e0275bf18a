"""The Triton rotary kernel (``rope_triton``): where it runs, and (in a subprocess under the Triton interpreter,
``rope_interpreted.py``) the kernel and ``fused_rope``'s op with it against the eager formulas and transformers."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.training.kernels import fused_rope, rope_triton

REPO = Path(__file__).resolve().parents[4]
INTERPRETED = Path(__file__).with_name("rope_interpreted.py")
# where `make venv` puts triton on a CPU machine: a folder of its own, outside the venv's site-packages (Makefile)
TRITON_FOLDER = Path(sys.prefix) / "triton-interpreter"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None and not TRITON_FOLDER.is_dir(),
                    reason="no triton: `make venv` installs it into .venv/triton-interpreter")
def test_the_kernel_and_the_op_under_the_triton_interpreter():
    """TRITON_INTERPRET must be set before triton is imported: a process of its own, with the Triton folder on its
    path."""
    path = os.pathsep.join(p for p in (str(TRITON_FOLDER), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


def _qk_cos_sin(dtype=torch.bfloat16):
    q, k = torch.zeros(1, 5, 4, 8, dtype=dtype), torch.zeros(1, 5, 2, 8, dtype=dtype)
    return q, k, torch.zeros(1, 5, 1, 8, dtype=dtype), torch.zeros(1, 5, 1, 8, dtype=dtype)


def test_runs_only_on_cuda_or_the_interpreter_in_bf16_or_fp16(monkeypatch):
    """The refusals decided before triton is imported (the interpreted file checks shapes and strides with it)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not rope_triton.runs(*_qk_cos_sin())  # the CPU, no interpreter: never imports triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not rope_triton.runs(*_qk_cos_sin(torch.float32))  # float32: tests only (DTYPES)
    q, k, cos, sin = _qk_cos_sin()
    assert not rope_triton.runs(q, k.half(), cos, sin)
    assert not rope_triton.runs(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, L, D]: not the op's view


def test_the_op_takes_the_kernel_only_when_compiling(monkeypatch):
    """Eager (``compile`` off: the CPU) never asks the kernel; compiled, a call it refuses runs the compiled
    formulas."""
    asked = []
    monkeypatch.setattr(rope_triton, "runs", lambda *a: asked.append(a) or False)
    monkeypatch.setattr(fused_rope, "kernel", lambda fn, compile: fn)
    q, k, cos, sin = _qk_cos_sin(torch.float32)
    cos = cos.squeeze(2)
    q, k = q.transpose(1, 2).requires_grad_(), k.transpose(1, 2).requires_grad_()
    want = fused_rope.fused_rope(q, k, cos, sin.squeeze(2))
    assert not asked
    got = fused_rope.fused_rope(q, k, cos, sin.squeeze(2), compile=True)
    sum(t.sum() for t in got).backward()
    assert len(asked) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
