"""The LoRA SwiGLU MLP's Triton kernels (``swiglu_lora_triton``): where they run, the switch, and (in a subprocess
under the Triton interpreter, ``swiglu_lora_interpreted.py``) the kernels and the op with them against torch."""

from pathlib import Path

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels import swiglu_lora_triton
from backends.training.trainer import GRPOTrainer
from tests.triton_interpreter import assert_passes_interpreted, needs_triton

INTERPRETED = Path(__file__).with_name("swiglu_lora_interpreted.py")


@needs_triton
def test_the_kernels_and_the_op_under_the_triton_interpreter():
    """TRITON_INTERPRET must be set before triton is imported: a process of its own (tests/triton_interpreter.py)."""
    assert_passes_interpreted(INTERPRETED, timeout=280)


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
