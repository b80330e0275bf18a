"""The fused LoRA ops with the rank-r product first and the base GEMM adding into it (``low_rank_first``): the same
function and gradients as today's order (the bias added once), in the linear op, the lean SwiGLU op and the trainer
with every composition of the fused switches; an FP8 base product keeps today's order."""

import contextlib
import dataclasses

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime, lora_linear
from backends.training.kernels.lean_ops import lora_swiglu
from backends.training.trainer import GRPOTrainer
from tests.unit.backends.training.test_fold_lora_b import (
    RUNTIMES,
    _close,
    _grads,
    _linear,
    _masters,
    _swiglu_parts,
    assert_same_training,
    bf16_runs_against_fp32,
    train,
)

pytestmark = pytest.mark.usefixtures("single_thread")

RUNTIME_IDS = ["autograd", "into-masters", "cached+into-masters"]


def _scope(runtime):
    return runtime.casts.scope() if runtime.casts is not None else contextlib.nullcontext()


def _reordered(runtime: LoraRuntime, on: bool) -> LoraRuntime:
    return dataclasses.replace(runtime, low_rank_first=on)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
def test_reordered_linear_equals_todays_order_and_the_formula(runtime, bias):
    g = torch.Generator().manual_seed(0)
    layer = _linear(g, 9, 14, bias=bias)
    a, b = _masters(g, 9, 14, 3)
    x = torch.randn(2, 5, 14, generator=g)
    upstream = torch.randn(2, 5, 9, generator=g)
    runs = {}
    for on in (False, True):
        xi, ai, bi = (t.detach().clone().requires_grad_() for t in (x, a, b))
        with _scope(runtime):
            out = lora_linear(xi, layer.weight, layer.bias, ai, bi, 0.5, runtime=_reordered(runtime, on))
            runs[on] = (out.detach(), _grads(out, upstream, (xi, ai, bi)))
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-6, atol=1e-6)
    _close(runs[True][1], runs[False][1], ("dx", "dA", "dB"))
    # the formula in float64: the bias lands once, the low-rank term is there
    x64, w64, a64, b64 = (t.detach().double() for t in (x, layer.weight, a, b))
    want = x64 @ w64.t() + 0.5 * (x64 @ a64.t()) @ b64.t() + (layer.bias.double() if bias else 0)
    torch.testing.assert_close(runs[True][0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
def test_reordered_swiglu_equals_todays_order(runtime):
    g = torch.Generator().manual_seed(2)
    linears, masters = _swiglu_parts(g, 12, 20, 4)
    x = torch.randn(3, 5, 12, generator=g)
    upstream = torch.randn(3, 5, 12, generator=g)
    runs = {}
    for on in (False, True):
        ms = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in masters]
        parts = [LoraParts(lin.weight, None, a, b, s) for lin, (a, b), s in zip(linears, ms, (0.5, 2.0, 1.5))]
        xi = x.clone().requires_grad_()
        with _scope(runtime):
            out = lora_swiglu(xi, *parts, runtime=_reordered(runtime, on))
            runs[on] = (out.detach(), _grads(out, upstream, (xi, *(t for m in ms for t in m))))
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-6, atol=1e-6)
    _close(runs[True][1], runs[False][1], ("dx", "gate dA", "gate dB", "up dA", "up dB", "down dA", "down dB"))


COMPOSITIONS = {  # name: settings on top of the fused ops, all with checkpointing of half the layers
    "lean+recompute-norm": dict(memory_efficient_ops="on", recompute_norm="on"),
    "lean": dict(memory_efficient_ops="on", recompute_norm="off", cache_lora_casts="off", accumulate_lora_grads="off"),
    "linears-only": dict(memory_efficient_ops="off"),
    "fold-b": dict(memory_efficient_ops="on", fold_lora_b="on"),
    "fold-a": dict(memory_efficient_ops="on", recompute_norm="on", fold_lora_a="on"),
    "group-qkv": dict(memory_efficient_ops="on", recompute_norm="on", group_qkv="on"),
}


def _run(tiny_model_path, tmp_path=None, **cfg):
    run = train(tiny_model_path, tmp_path, **cfg)
    runtimes = {m._trajflow_lora_runtime.low_rank_first for m in run[0].model.modules()
                if hasattr(m, "_trajflow_lora_runtime")}
    assert runtimes == {cfg.get("low_rank_first") == "on"}  # every patched op reads the switch
    return run


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_trainer_steps_reordered_equal_todays_order(tiny_model_path, tmp_path, composition):
    """Qwen2's q, k and v carry biases: the loss, logprobs and every LoRA gradient matching today's order is the
    bias added once."""
    cfg = dict(fused_lora="on", learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=True,
               checkpoint_layer_fraction=0.5, micro_batch_tokens=16, **COMPOSITIONS[composition])
    runs = {mode: _run(tiny_model_path, tmp_path / mode, low_rank_first=mode, **cfg) for mode in ("off", "on")}
    assert_same_training(runs["on"], runs["off"], cfg["learning_rate"], "low_rank_first")


def test_fp8_modules_keep_todays_order(tiny_model_path):
    """Every module of the tiny model is quantized: with fp8_base the switch changes no bit."""
    cfg = dict(fused_lora="on", memory_efficient_ops="on", fp8_base="on", learning_rate=1e-3, micro_batch_tokens=16)
    runs = {mode: _run(tiny_model_path, low_rank_first=mode, **cfg) for mode in ("off", "on")}
    assert runs["on"][0].fp8_lora_layers == 14
    assert [m["loss"] for m in runs["on"][1]] == [m["loss"] for m in runs["off"][1]]
    assert all(torch.equal(runs["on"][2][k], runs["off"][2][k]) for k in runs["off"][2])


def test_bf16_trainer_steps_reordered_are_as_close_to_fp32_as_todays_order(tiny_model_path):
    bf16_runs_against_fp32(tiny_model_path, _run, "low_rank_first")


def test_the_switch_is_on_on_cuda_needs_fused_lora_and_is_baked_in(tiny_model_path):
    assert TrainerConfig().low_rank_first == "auto" and TrainerConfig(low_rank_first=True).low_rank_first == "on"
    assert TrainerConfig().enabled("low_rank_first", True)  # 'auto' is on on CUDA (fused_lora's 'auto' too)
    assert not TrainerConfig().enabled("low_rank_first", False)  # and off on the CPU
    assert TrainerConfig(low_rank_first="on").enabled("low_rank_first", True)
    assert not TrainerConfig(low_rank_first="on").enabled("low_rank_first", False)  # fused_lora is off on the CPU
    assert not TrainerConfig(fused_lora="off", low_rank_first="on").enabled("low_rank_first", True)
    assert TrainerConfig(fused_lora="on", low_rank_first="on", fp8_base="on").enabled("low_rank_first", False)
    with pytest.raises(ValueError, match="low_rank_first"):
        TrainerConfig(low_rank_first="maybe")
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", low_rank_first="on"))
    with pytest.raises(ValueError, match="low_rank_first"):
        trainer.update_config(low_rank_first="off")
