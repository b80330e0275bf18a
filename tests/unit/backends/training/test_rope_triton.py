"""The Triton rotary kernel (``rope_triton``): where it runs, and (in a subprocess under the Triton interpreter,
``rope_interpreted.py``) the kernel and ``fused_rope``'s op with it against the eager formulas and transformers."""

from pathlib import Path

import pytest
import torch

from backends.training.kernels import fused_rope, rope_triton
from tests.triton_interpreter import assert_passes_interpreted, needs_triton

INTERPRETED = Path(__file__).with_name("rope_interpreted.py")


@needs_triton
def test_the_kernel_and_the_op_under_the_triton_interpreter():
    """TRITON_INTERPRET must be set before triton is imported: a process of its own (tests/triton_interpreter.py)."""
    assert_passes_interpreted(INTERPRETED, timeout=120)


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
