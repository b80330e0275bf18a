"""The LoRA SwiGLU MLP's Triton kernels (``swiglu_lora_triton``): where they run, the switch, and (in a subprocess
under the Triton interpreter, ``swiglu_lora_interpreted.py``) the kernels and the op with them against torch."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels import swiglu_lora_triton
from backends.training.trainer import GRPOTrainer

REPO = Path(__file__).resolve().parents[4]
INTERPRETED = Path(__file__).with_name("swiglu_lora_interpreted.py")
# where `make venv` puts triton on a CPU machine: a folder of its own, outside the venv's site-packages (Makefile)
TRITON_FOLDER = Path(sys.prefix) / "triton-interpreter"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None and not TRITON_FOLDER.is_dir(),
                    reason="no triton: `make venv` installs it into .venv/triton-interpreter")
def test_the_kernels_and_the_op_under_the_triton_interpreter():
    """TRITON_INTERPRET must be set before triton is imported: a process of its own, with the Triton folder on its
    path."""
    path = os.pathsep.join(p for p in (str(TRITON_FOLDER), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout


def test_runs_only_on_cuda_or_the_interpreter_in_bf16_or_fp16_with_ranks_of_at_least_16(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not swiglu_lora_triton.runs(g, g, (16, 16, 16))  # the CPU, no interpreter: never imports triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for ranks in ((8, 8, 8), (24, 24, 24), (16, 16, 32), (32, 16, 32)):
        assert not swiglu_lora_triton.runs(g, g, ranks)
    assert not swiglu_lora_triton.runs(g.float(), g.float(), (16, 16, 16))  # float32: tests only (DTYPES)
    assert not swiglu_lora_triton.runs(g.t(), g.t(), (16, 16, 16))  # not row-major


def test_the_switch_is_auto_on_cuda_needs_the_lean_fused_op_and_is_baked_in(tiny_model_path):
    assert TrainerConfig().fused_swiglu_lora == "auto"
    assert TrainerConfig(fused_swiglu_lora=False).fused_swiglu_lora == "off"
    assert TrainerConfig().enabled("fused_swiglu_lora", True)  # 'auto': on CUDA
    assert not TrainerConfig().enabled("fused_swiglu_lora", False)
    lean = dict(fused_lora="on", memory_efficient_ops="on")
    assert TrainerConfig(**lean, fused_swiglu_lora="on").enabled("fused_swiglu_lora", False)
    assert not TrainerConfig(fused_lora="off").enabled("fused_swiglu_lora", True)
    assert not TrainerConfig(memory_efficient_ops="off").enabled("fused_swiglu_lora", True)
    assert not TrainerConfig(fused_swiglu_lora="off").enabled("fused_swiglu_lora", True)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**lean, fused_swiglu_lora="on"))
    runtimes = {m._trajflow_lora_runtime.fused_swiglu for m in trainer._lm.modules()
                if hasattr(m, "_trajflow_lora_runtime")}
    assert runtimes == {True}
    with pytest.raises(ValueError, match="fused_swiglu_lora"):
        trainer.update_config(fused_swiglu_lora="off")
