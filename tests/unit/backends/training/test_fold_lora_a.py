"""LoRA's A folded into the base input-gradient GEMM (kernels/fold_lora_a.py): the same function and gradients as the
unfolded fused ops, the weight seen as the plain matrix in its own storage, the A_c rows never stale, and only paying
modules folded, never one that fold_lora_b or group_qkv folded."""

import contextlib

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fold_lora_a import RowFoldedWeight, fold_model_rows, fold_rows, pays, saved_bytes
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime, fusable_parts, lora_linear
from backends.training.kernels.lean_ops import lora_swiglu
from backends.training.kernels.lora_cast_cache import CastCache, cast_lora
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import assert_same_model_state
from tests.unit.backends.training.test_fold_lora_b import (
    _close,
    _grads,
    _linear,
    _masters,
    assert_never_stale,
    assert_same_param_grads_without_dx,
    assert_same_training,
    bf16_runs_against_fp32,
    linear_runs,
    train,
)

pytestmark = pytest.mark.usefixtures("single_thread")

RUNTIMES = [LoraRuntime(), LoraRuntime(grads_into_masters=True), LoraRuntime(CastCache(), True)]
RUNTIME_IDS = ["autograd", "into-masters", "cached+into-masters"]


def _scope(runtime):
    return runtime.casts.scope() if runtime.casts is not None else contextlib.nullcontext()


@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
def test_row_folded_linear_equals_unfolded(runtime):
    layer, runs = linear_runs(runtime, 7, 20, 4, lambda layer, rank: {"row_fold": fold_rows(layer, rank)})
    assert torch.equal(runs[True][0], runs[False][0])  # the forward is untouched
    _close(runs[True][1], runs[False][1], ("dx", "dA", "dB"))
    fold = layer._trajflow_row_fold
    assert fold._written is not None  # the folded product ran
    assert layer.weight.shape == (7, 20) and not layer.weight.requires_grad
    assert layer.weight.data_ptr() == fold.buffer.data_ptr() and layer.weight.is_contiguous()


def test_row_folded_linear_without_an_input_gradient_runs_the_plain_gz():
    kwargs = assert_same_param_grads_without_dx(3, 9, 2, lambda layer, rank: {"row_fold": fold_rows(layer, rank)})
    assert kwargs["row_fold"]._written is None  # no dx: nothing to fold into


def test_a_weight_given_another_tensor_runs_unfolded_on_it():
    g = torch.Generator().manual_seed(5)
    layer = _linear(g, 4, 9)
    a, b = _masters(g, 4, 9, 3)
    fold = fold_rows(layer, 3)
    layer.weight.data = layer.weight.data * 2  # what Module.to / _apply do: the Parameter gets a tensor of its own
    x = torch.randn(4, 9, generator=g, requires_grad=True)
    upstream = torch.randn(4, 4, generator=g)
    (dx,) = torch.autograd.grad((lora_linear(x, layer.weight, layer.bias, a, b, 0.5, row_fold=fold) * upstream).sum(),
                                (x,))
    torch.testing.assert_close(dx, upstream @ layer.weight + (upstream @ b * 0.5) @ a, rtol=1e-5, atol=1e-5)
    assert fold._written is None  # never folded


@pytest.mark.parametrize("fold_pair", [False, True], ids=["gate-up-plain", "gate-up-column-folded"])
@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
def test_swiglu_with_down_row_folded_equals_unfolded(runtime, fold_pair):
    from backends.training.kernels.fold_lora_b import fold_linears

    g = torch.Generator().manual_seed(2)
    hidden, inter, rank = 12, 20, 4
    linears = [_linear(g, inter, hidden, False), _linear(g, inter, hidden, False), _linear(g, hidden, inter, False)]
    masters = [_masters(g, inter, hidden, rank), _masters(g, inter, hidden, rank), _masters(g, hidden, inter, rank)]
    if fold_pair:
        fold_linears(linears[:2], [rank, rank])
    x = torch.randn(3, 5, hidden, generator=g)
    upstream = torch.randn(3, 5, hidden, generator=g)
    runs = {}
    for folded in (False, True):
        if folded:
            fold_rows(linears[2], rank)
        ms = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in masters]
        parts = [LoraParts(lin.weight, None, a, b, s, getattr(lin, "_trajflow_fold", None),
                           row_fold=getattr(lin, "_trajflow_row_fold", None))
                 for lin, (a, b), s in zip(linears, ms, (0.5, 2.0, 1.5))]
        xi = x.clone().requires_grad_()
        with _scope(runtime):
            out = lora_swiglu(xi, *parts, runtime=runtime)
            grads = _grads(out, upstream, (xi, *(t for m in ms for t in m)))
        runs[folded] = (out.detach(), grads)
    assert torch.equal(runs[True][0], runs[False][0])
    _close(runs[True][1], runs[False][1], ("dx", "gate dA", "gate dB", "up dA", "up dB", "down dA", "down dB"))
    assert linears[2]._trajflow_row_fold._written is not None  # the folded product ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["cast-copies", "the-master-itself"])
def test_the_rows_are_written_from_each_new_cast_and_never_stale(dtype):
    g = torch.Generator().manual_seed(3)
    layer = _linear(g, 4, 10, bias=False).to(dtype)
    fold = fold_rows(layer, 2)
    a, b = (torch.nn.Parameter(t.detach()) for t in _masters(g, 4, 10, 2))
    cache = CastCache()

    def rows_are_current():
        return torch.equal(fold.rows, cast_lora(a, b, 0.5, dtype)[0])

    def step():
        x = torch.randn(4, 10, generator=g).to(dtype).requires_grad_()
        lora_linear(x, layer.weight, None, a, b, 0.5, runtime=LoraRuntime(cache), row_fold=fold).sum().backward()

    weight = layer.weight.detach().clone()
    assert_never_stale(step, rows_are_current, fold, cache, a, b, outside=a)
    assert torch.equal(layer.weight, weight)


def _row_folded(trainer) -> set[str]:
    return {n.split(".")[-2] for n, m in trainer._lm.named_modules()
            if isinstance(getattr(m, "_trajflow_row_fold", None), RowFoldedWeight)}


def test_on_folds_the_paying_modules_never_twice_nor_a_column_folded_one(tiny_model_path):
    assert pays(1536, 8960, 16) and pays(256, 1536, 16) and not pays(1536, 1536, 16) and not pays(8960, 1536, 16)
    cfg = dict(fused_lora="on", memory_efficient_ops="on")
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg, fold_lora_a="on"))
    # hidden 64, intermediate 128, k and v 2 x 16, r 8: down (128 -> 64), k and v (64 -> 32) of 2 layers
    assert trainer.row_folded_lora_layers == 6 and _row_folded(trainer) == {"down_proj", "k_proj", "v_proj"}
    assert fold_model_rows(trainer._lm, fusable_parts) == 0  # nothing twice
    assert GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg)).row_folded_lora_layers == 0  # 'off'
    grouped = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg, fold_lora_a="on", group_qkv="on"))
    assert grouped.grouped_qkv_layers > 0 and _row_folded(grouped) == {"down_proj"}
    column = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg, fold_lora_a="on", fold_lora_b="on"))
    assert column.folded_lora_layers == 14 and column.row_folded_lora_layers == 0
    fp8 = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg, fold_lora_a="on", fp8_base="on"))
    assert fp8.fp8_lora_layers == 14 and fp8.row_folded_lora_layers == 0
    wide = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg, fold_lora_a="on", lora_rank=64, lora_alpha=64))
    assert wide.row_folded_lora_layers == 0  # in <= out + r everywhere


def _run(tiny_model_path, tmp_path=None, **cfg):
    run = train(tiny_model_path, tmp_path, **cfg)
    trainer = run[0]
    folds = {n: m._trajflow_row_fold for n, m in trainer._lm.named_modules()
             if isinstance(getattr(m, "_trajflow_row_fold", None), RowFoldedWeight)}
    assert len(folds) == trainer.row_folded_lora_layers
    # the folded products ran; without checkpointing the first layer's input needs no gradient, so its k and v none
    assert all(f._written is not None for n, f in folds.items() if cfg.get("gradient_checkpointing") or ".0." not in n)
    return run


COMPOSITIONS = {  # name: settings on top of the fused ops
    "lean+recompute-norm": dict(memory_efficient_ops="on", recompute_norm="on"),
    "lean": dict(memory_efficient_ops="on", recompute_norm="off", cache_lora_casts="off", accumulate_lora_grads="off"),
    "linears-only": dict(memory_efficient_ops="off"),
    "group-qkv": dict(memory_efficient_ops="on", recompute_norm="on", group_qkv="on"),
}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
def test_trainer_steps_with_fold_equal_fold_off(tiny_model_path, tmp_path, composition):
    cfg = dict(fused_lora="on", learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=True,
               checkpoint_layer_fraction=0.5, micro_batch_tokens=16, **COMPOSITIONS[composition])
    runs = {mode: _run(tiny_model_path, tmp_path / mode, fold_lora_a=mode, **cfg) for mode in ("off", "on")}
    assert runs["off"][0].row_folded_lora_layers == 0
    assert runs["on"][0].row_folded_lora_layers == (2 if composition == "group-qkv" else 6)
    assert_same_training(runs["on"], runs["off"], cfg["learning_rate"], "fold_lora_a")


def test_row_folded_weights_read_as_the_plain_matrices_and_only_lora_is_saved(tiny_model_path, tmp_path):
    off = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on"))
    on = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fold_lora_a="on"))
    assert on.row_folded_lora_layers == 6
    assert_same_model_state(on, off)
    on.save_checkpoint(tmp_path / "ckpt")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert saved.keys() == load_file(_saved(off, tmp_path / "off")).keys()


def _saved(trainer, path):
    trainer.save_checkpoint(path)
    return path / "adapter" / "adapter_model.safetensors"


def test_the_switch_is_auto_on_cuda_off_with_fp8_and_baked_in(tiny_model_path):
    assert TrainerConfig().fold_lora_a == "auto" and TrainerConfig(fold_lora_a=True).fold_lora_a == "on"
    assert TrainerConfig().enabled("fold_lora_a", True)  # 'auto': on CUDA, where fused_lora's 'auto' is on
    assert not TrainerConfig().enabled("fold_lora_a", False)  # and off on the CPU, with fused_lora
    assert TrainerConfig(fused_lora="on").enabled("fold_lora_a", False) is False  # 'auto' is CUDA's only
    assert TrainerConfig(fused_lora="on", fold_lora_a="on").enabled("fold_lora_a", False)
    assert not TrainerConfig(fused_lora="off", fold_lora_a="on").enabled("fold_lora_a", True)
    assert not TrainerConfig(fused_lora="on", fold_lora_a="on", fp8_base="on").enabled("fold_lora_a", False)
    with pytest.raises(ValueError, match="fold_lora_a"):
        TrainerConfig(fold_lora_a="maybe")
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fold_lora_a="on"))
    with pytest.raises(ValueError, match="fold_lora_a"):
        trainer.update_config(fold_lora_a="off")


def test_bf16_trainer_steps_with_fold_are_as_close_to_fp32_as_fold_off(tiny_model_path):
    assert bf16_runs_against_fp32(tiny_model_path, _run, "fold_lora_a")["on"][0].row_folded_lora_layers == 6


def test_the_docstrings_byte_table_is_what_saved_bytes_computes():
    def mb(in_f, out_f):
        return {k: round(v / 1e6, 1) for k, v in saved_bytes(24576, in_f, out_f, 16).items()}

    assert mb(8960, 1536) == {"dx_pass": 880.8, "g_copy": -151.0, "net": 729.8}
    assert mb(1536, 256) == {"dx_pass": 151.0, "g_copy": -25.2, "net": 125.8}
    assert mb(1536, 1536)["net"] == 0.0 and mb(1536, 8960)["net"] == -729.8
    layer = saved_bytes(24576, 8960, 1536, 16)["net"] + 2 * saved_bytes(24576, 1536, 256, 16)["net"]
    assert round(28 * saved_bytes(24576, 8960, 1536, 16)["net"] / 1e9, 1) == 20.4
    assert round(28 * layer / 1e9, 1) == 27.5
