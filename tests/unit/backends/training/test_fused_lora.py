"""Fused LoRA linear (fused_lora.patch_lora) and the compiled-logprob switch on the tiny model."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fused_lora import lora_linear
from backends.training.logprobs import chunked_logprobs, full_logprobs
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import (
    assert_same_adam_updates,
    assert_same_gradients,
    record_gradients,
    synthetic_group,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _lora_state(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def test_fused_op_matches_peft_formula_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=g, requires_grad=True)
    w, bias = torch.randn(7, 12, generator=g), torch.randn(7, generator=g)
    a = torch.randn(4, 12, generator=g, requires_grad=True)
    b = torch.randn(7, 4, generator=g, requires_grad=True)
    upstream = torch.randn(2, 5, 7, generator=g)
    for with_bias in (bias, None):
        ours = lora_linear(x, w, with_bias, a, b, 0.5)
        ref = torch.nn.functional.linear(x, w, with_bias) + (x @ a.t() @ b.t()) * 0.5
        assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=1e-5)
        got = torch.autograd.grad((ours * upstream).sum(), (x, a, b))
        want = torch.autograd.grad((ref * upstream).sum(), (x, a, b))
        for gg, ww in zip(got, want):
            assert torch.allclose(gg, ww, atol=1e-5)


def test_fused_trainer_step_equals_peft_and_falls_back_where_it_must(tiny_model_path):
    groups = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
    cfg = dict(learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=True, checkpoint_layer_fraction=0.5)
    runs = {}
    for mode in ("off", "on"):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora=mode, **cfg))
        grads = record_gradients(trainer)
        first = trainer.train_step(groups)  # KL shaping runs the adapter-disabled reference through peft
        second = trainer.train_step(groups)
        runs[mode] = (trainer, first, second, _lora_state(trainer), grads)
    assert runs["off"][0].fused_lora_layers == 0
    assert runs["on"][0].fused_lora_layers == 14  # 2 layers x 7 linear projections
    for step in (1, 2):
        ref, ours = runs["off"][step], runs["on"][step]
        for key in ("loss", "grad_norm", "entropy", "kl_policy_ref", "mismatch_kl"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (step, key)
    assert runs["on"][2]["kl_policy_ref"] != 0.0  # the reference really was the adapter-off model
    assert_same_gradients(runs["on"][4], runs["off"][4], "fused LoRA")
    assert_same_adam_updates(runs["on"][3], runs["off"][3], cfg["learning_rate"], 2, "fused LoRA")
    # same function outside training too, and peft's path is used when adapters are switched off
    trainer_on, trainer_off = runs["on"][0], runs["off"][0]
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    assert trainer_on.sequence_logprobs(prompt, completion) == pytest.approx(
        trainer_off.sequence_logprobs(prompt, completion), abs=1e-5)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad(), trainer_on.model.disable_adapter(), trainer_off.model.disable_adapter():
        assert torch.equal(trainer_on.model(input_ids=ids).logits, trainer_off.model(input_ids=ids).logits)


def test_fused_lora_with_dropout_uses_peft_and_resumes_bit_exactly(tiny_model_path, tmp_path):
    cfg = TrainerConfig(fused_lora="on", lora_dropout=0.1, learning_rate=5e-3, micro_batch_tokens=24, seed=3)
    groups = [[synthetic_group([0.0, 1.0 + k, 0.5], scenario_id=f"a{k}")] for k in range(3)]
    straight = GRPOTrainer(str(tiny_model_path), cfg)
    assert straight.fused_lora_layers == 14
    for k in range(3):
        straight.train_step(groups[k])
    straight.save_checkpoint(tmp_path / "straight")
    first = GRPOTrainer(str(tiny_model_path), cfg)
    first.train_step(groups[0])
    first.save_checkpoint(tmp_path / "after1")
    resumed = GRPOTrainer(str(tiny_model_path), cfg)
    resumed.load_checkpoint(tmp_path / "after1")
    for k in (1, 2):
        resumed.train_step(groups[k])
    resumed.save_checkpoint(tmp_path / "resumed")
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "straight" / adapter).read_bytes() == (tmp_path / "resumed" / adapter).read_bytes()
    with pytest.raises(ValueError, match="fused_lora"):
        straight.update_config(fused_lora="off")


def test_compiled_logprobs_fall_back_to_the_same_eager_math(monkeypatch):
    from backends.training.kernels import torch_compile as kernels

    kernels.reset()
    attempts = []

    def failing_compile(fn, dynamic):
        def compiled(*args):
            attempts.append(fn.__name__)
            raise RuntimeError("no triton on this machine")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(32, 8, generator=g)
    targets = torch.randint(0, 32, (10,), generator=g)
    eager_logp, eager_entropy = chunked_logprobs(hidden, weight, targets, chunk=3, temperature=0.7)
    (eager_grad,) = torch.autograd.grad(eager_logp.sum(), hidden)
    with pytest.warns(RuntimeWarning, match="running every kernel eagerly: RuntimeError: no triton on this machine"):
        logp, entropy = chunked_logprobs(hidden, weight, targets, chunk=3, temperature=0.7, compile=True)
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    assert attempts == ["_chunk_stats"]  # tried once, then eager for good (backward too)
    assert kernels.failure() == "RuntimeError: no triton on this machine"
    kernels.reset()
    assert torch.equal(logp, eager_logp) and torch.equal(entropy, eager_entropy) and torch.equal(grad, eager_grad)
    ref_logp, ref_entropy = full_logprobs(hidden, weight, targets, temperature=0.7)
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)


def test_cached_parts_are_reused_until_what_fusable_parts_reads_changes():
    from peft import LoraConfig, get_peft_model

    from backends.training.kernels.fold_lora_b import fold_linears
    from backends.training.kernels.fused_lora import cached_parts, fusable_parts

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 24)

    model = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]))
    layer = model.base_model.model.proj
    first = cached_parts(layer)
    assert first is not None and cached_parts(layer) is first  # the second call builds nothing
    assert (first.weight, first.scaling) == (fusable_parts(layer).weight, fusable_parts(layer).scaling)
    with model.disable_adapter():  # the KL reference pass: peft's own forward
        assert cached_parts(layer) is None
    assert cached_parts(layer) is not first and cached_parts(layer).lora_a is first.lora_a
    layer.scaling["default"] = 0.25
    assert cached_parts(layer).scaling == 0.25
    (fold,) = fold_linears([layer.base_layer], [4])  # a new base weight Parameter, and its fold
    parts = cached_parts(layer)
    assert parts.fold is fold and parts.weight is layer.base_layer.weight
    layer.base_layer.weight.requires_grad_(True)  # a trainable base weight is not fusable
    assert cached_parts(layer) is None
    assert cached_parts(torch.nn.Linear(2, 2)) is None  # no LoRA layer at all


def test_as_dtype_is_to_without_the_call_where_nothing_changes():
    from backends.training.kernels.fused_lora import as_dtype

    t = torch.arange(6.0).reshape(2, 3)
    assert as_dtype(t, torch.float32) is t and t.to(torch.float32) is t  # what `to` itself returns
    half = as_dtype(t, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, t.to(torch.bfloat16))


def test_autocast_off_switches_autocast_off_inside_and_back_on_after():
    from backends.training.kernels.fused_lora import autocast_off

    x = torch.randn(3, 4)
    with autocast_off("cpu"):  # off outside: nothing to do
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x.t()).dtype == torch.bfloat16
        with autocast_off("cpu"):
            assert not torch.is_autocast_enabled("cpu") and (x @ x.t()).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        with pytest.raises(ValueError), autocast_off("cpu"):
            raise ValueError
        assert torch.is_autocast_enabled("cpu") and (x @ x.t()).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
