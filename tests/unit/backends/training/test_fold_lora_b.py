"""LoRA's B product folded into the base GEMM (kernels/fold_lora_b.py): the same function and gradients as the unfolded
fused ops, the weight seen as the plain matrix, the (sB)_c columns never stale, and only paying modules under 'auto'."""

import contextlib

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fold_lora_b import FoldedWeight, fold_linears, fold_model, pays, runs_folded
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime, fusable_parts, lora_linear
from backends.training.kernels.lean_ops import lora_swiglu
from backends.training.kernels.lora_cast_cache import CastCache, cast_lora
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import (
    assert_as_close_to_exact,
    assert_same_adam_updates,
    assert_same_gradients,
    assert_same_model_state,
    record_gradients,
    synthetic_group,
)

pytestmark = pytest.mark.usefixtures("single_thread")

GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
RUNTIMES = [LoraRuntime(), LoraRuntime(grads_into_masters=True), LoraRuntime(CastCache(), True)]


def _linear(g, out_f, in_f, bias=True):
    layer = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=g))
    layer.requires_grad_(False)
    return layer


def _masters(g, out_f, in_f, rank):
    a = torch.randn(rank, in_f, generator=g).requires_grad_()
    return a, torch.randn(out_f, rank, generator=g).requires_grad_()


def _grads(out, upstream, inputs):
    loss = (out * upstream).sum()
    loss.backward()
    return [t.grad.clone() for t in inputs]


def _close(got, want, what):
    for name, a, b in zip(what, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=name)


def linear_runs(runtime, out_f: int, in_f: int, rank: int, fold):
    """(layer, {False: (y, (dx, dA, dB)), True: ...}): ``lora_linear`` unfolded, then with the keyword arguments that
    ``fold(layer, rank)`` returns (it folds the layer's weight)."""
    g = torch.Generator().manual_seed(0)
    layer = _linear(g, out_f, in_f)
    a, b = _masters(g, out_f, in_f, rank)
    x = torch.randn(2, 5, in_f, generator=g)
    upstream = torch.randn(2, 5, out_f, generator=g)
    runs = {}
    for folded in (False, True):
        kwargs = fold(layer, rank) if folded else {}
        xi, ai, bi = (t.detach().clone().requires_grad_() for t in (x, a, b))
        with (runtime.casts.scope() if runtime.casts is not None else contextlib.nullcontext()):
            out = lora_linear(xi, layer.weight, layer.bias, ai, bi, 0.5, runtime=runtime, **kwargs)
            grads = _grads(out, upstream, (xi, ai, bi))
        runs[folded] = (out.detach(), grads)
    return layer, runs


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["autograd", "into-masters", "cached+into-masters"])
def test_folded_linear_equals_unfolded(runtime):
    layer, runs = linear_runs(runtime, 20, 12, 4, lambda layer, rank: {"fold": fold_linears([layer], [rank])[0]})
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    _close(runs[True][1], runs[False][1], ("dx", "dA", "dB"))
    assert layer._trajflow_fold._written is not None  # the folded product ran
    assert layer.weight.shape == (20, 12) and not layer.weight.requires_grad
    assert layer.weight.data_ptr() == layer._trajflow_fold.buffer.data_ptr()


def test_folded_linear_without_an_input_gradient():
    kwargs = assert_same_param_grads_without_dx(9, 6, 3, lambda layer, rank: {"fold": fold_linears([layer], [rank])[0]})
    assert kwargs["fold"]._written is not None


def assert_same_param_grads_without_dx(out_f: int, in_f: int, rank: int, fold) -> dict:
    """``lora_linear``'s (dA, dB) where x needs no gradient, unfolded and with the keyword arguments that
    ``fold(layer, rank)`` returns (it folds the layer's weight), agree; returns those arguments."""
    g = torch.Generator().manual_seed(1)
    layer = _linear(g, out_f, in_f, bias=False)
    a, b = _masters(g, out_f, in_f, rank)
    x, upstream = torch.randn(7, in_f, generator=g), torch.randn(7, out_f, generator=g)
    want = torch.autograd.grad((lora_linear(x, layer.weight, None, a, b, 2.0) * upstream).sum(), (a, b))
    kwargs = fold(layer, rank)
    got = torch.autograd.grad((lora_linear(x, layer.weight, None, a, b, 2.0, **kwargs) * upstream).sum(), (a, b))
    _close(got, want, ("dA", "dB"))
    return kwargs


def test_a_weight_given_another_tensor_runs_unfolded_on_it():
    g = torch.Generator().manual_seed(5)
    layer = _linear(g, 9, 6)
    a, b = _masters(g, 9, 6, 3)
    fold = fold_linears([layer], [3])[0]
    layer.weight.data = layer.weight.data * 2  # what Module.to / _apply do: the Parameter gets a tensor of its own
    x = torch.randn(4, 6, generator=g)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias) + (x @ a.t() @ b.t()) * 0.5
    got = lora_linear(x, layer.weight, layer.bias, a, b, 0.5, fold=fold)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fold._written is None  # never folded


def _swiglu_parts(g, hidden, inter, rank):
    linears = [_linear(g, inter, hidden, False), _linear(g, inter, hidden, False), _linear(g, hidden, inter, False)]
    masters = [_masters(g, inter, hidden, rank), _masters(g, inter, hidden, rank), _masters(g, hidden, inter, rank)]
    return linears, masters


@pytest.mark.parametrize("fold_down", [False, True])
@pytest.mark.parametrize("runtime", RUNTIMES, ids=["autograd", "into-masters", "cached+into-masters"])
def test_folded_swiglu_equals_unfolded(runtime, fold_down):
    g = torch.Generator().manual_seed(2)
    hidden, inter, rank = 12, 20, 4
    linears, masters = _swiglu_parts(g, hidden, inter, rank)
    x = torch.randn(3, 5, hidden, generator=g)
    upstream = torch.randn(3, 5, hidden, generator=g)
    scalings = (0.5, 2.0, 1.5)
    runs = {}
    for folded in (False, True):
        if folded:
            fold_linears(linears[:2], [rank, rank])
            if fold_down:
                fold_linears(linears[2:], [rank])
        ms = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in masters]
        parts = [LoraParts(lin.weight, None, a, b, s, getattr(lin, "_trajflow_fold", None))
                 for lin, (a, b), s in zip(linears, ms, scalings)]
        xi = x.clone().requires_grad_()
        with (runtime.casts.scope() if runtime.casts is not None else contextlib.nullcontext()):
            out = lora_swiglu(xi, *parts, runtime=runtime)
            grads = _grads(out, upstream, (xi, *(t for m in ms for t in m)))
        runs[folded] = (out.detach(), grads)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    _close(runs[True][1], runs[False][1], ("dx", "gate dA", "gate dB", "up dA", "up dB", "down dA", "down dB"))
    assert [hasattr(lin, "_trajflow_fold") and lin._trajflow_fold._written is not None for lin in linears] == [
        True, True, fold_down]  # the folded products ran


def test_the_tail_is_written_from_each_new_cast_and_never_stale():
    g = torch.Generator().manual_seed(3)
    layer = _linear(g, 10, 6, bias=False)
    fold = fold_linears([layer], [2])[0]
    a, b = (torch.nn.Parameter(t.detach()) for t in _masters(g, 10, 6, 2))
    cache = CastCache()

    def tail_is_current():
        _, sb = cast_lora(a, b, 0.5, torch.float32)
        return torch.equal(fold.tail, sb)

    def forward():
        return lora_linear(torch.randn(4, 6, generator=g), layer.weight, None, a, b, 0.5, runtime=LoraRuntime(cache),
                           fold=fold)

    weight = layer.weight.detach().clone()
    assert_never_stale(forward, tail_is_current, fold, cache, a, b, outside=b)
    assert torch.equal(layer.weight, weight)


def assert_never_stale(call, is_current, fold, cache, a, b, outside) -> None:
    """``call()`` runs a folded op whose buffer takes a cast of the masters ``a``, ``b`` through ``cache``;
    ``is_current()``: the buffer holds what the masters give now. Checked after the first call, a reused copy (nothing
    rewritten), an optimizer step and a loaded state (the masters move in place: a new copy), and, outside a scope
    (copies made per call), a write through ``.data`` of ``outside``."""
    with cache.scope():
        call()
        assert is_current() and cache.fills == 1
        written = fold._written
        call()
        assert fold._written is written and cache.hits == 1  # a reused copy (or the master itself): not rewritten
        torch.optim.AdamW([a, b], lr=0.1).step()
        call()
        assert is_current()
        holder = torch.nn.Module()
        holder.a, holder.b = a, b
        holder.load_state_dict({"a": torch.zeros_like(a), "b": torch.ones_like(b)})
        call()
        assert is_current()
    outside.data.mul_(3.0)
    call()
    assert is_current()


def test_pays_and_auto_folds_only_the_mlps_gate_and_up(tiny_model_path):
    assert pays([8960, 8960], 1536, [16, 16]) and not pays([1536], 1536, [16]) and not pays([1536], 8960, [16])
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", memory_efficient_ops="on"))
    assert trainer.folded_lora_layers == 0  # CPU: 'auto' is off
    assert fold_model(trainer._lm, fusable_parts, only_where_it_pays=True) == 4  # 2 layers x gate, up (64 -> 128)
    folded = {n for n, m in trainer._lm.named_modules() if isinstance(getattr(m, "_trajflow_fold", None), FoldedWeight)}
    assert {n.split(".")[-2] for n in folded} == {"gate_proj", "up_proj"}
    assert fold_model(trainer._lm, fusable_parts, only_where_it_pays=False) == 10  # the rest; gate, up not twice


def _folds(trainer) -> list[FoldedWeight]:
    return [m._trajflow_fold for m in trainer._lm.modules() if isinstance(getattr(m, "_trajflow_fold", None),
                                                                          FoldedWeight)]


def train(tiny_model_path, tmp_path=None, **cfg):
    """(trainer, metrics, LoRA weights, gradients) of two steps; with ``tmp_path`` two more around a checkpoint saved
    after step 2 and loaded back (the loaded masters must reach the folded columns or rows)."""
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg))
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(GROUPS) for _ in range(2)]
    if tmp_path is not None:
        trainer.save_checkpoint(tmp_path / "after2")
        metrics.append(trainer.train_step(GROUPS))
        trainer.load_checkpoint(tmp_path / "after2")
        metrics.append(trainer.train_step(GROUPS))
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return trainer, metrics, weights, grads


def _run(tiny_model_path, tmp_path=None, **cfg):
    run = train(tiny_model_path, tmp_path, **cfg)
    trainer = run[0]
    assert len(_folds(trainer)) == trainer.folded_lora_layers and all(f._written is not None for f in _folds(trainer))
    return run


def assert_same_training(on_run, off_run, learning_rate: float, where: str):
    """Two ``train`` runs (with a checkpoint round trip) agree: metrics, gradients, Adam updates, logprobs, and the
    base model (adapters disabled: the weight views) bit for bit."""
    for step, (ours, ref) in enumerate(zip(on_run[1], off_run[1])):
        for key in ("loss", "grad_norm", "entropy", "kl_policy_ref", "mismatch_kl"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (step, key)
    assert on_run[1][0]["micro_batches"] >= 2
    assert_same_gradients(on_run[3], off_run[3], where)
    assert_same_adam_updates(on_run[2], off_run[2], learning_rate, 4, where)
    on, off = on_run[0], off_run[0]
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    assert on.sequence_logprobs(prompt, completion) == pytest.approx(off.sequence_logprobs(prompt, completion),
                                                                      abs=1e-5)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad(), on.model.disable_adapter(), off.model.disable_adapter():  # the base model: the weight views
        assert torch.equal(on.model(input_ids=ids).logits, off.model(input_ids=ids).logits)


@pytest.mark.parametrize("lean,cache,into", [("on", "on", "on"), ("on", "off", "off"), ("off", "on", "on"),
                                             ("off", "off", "off")])
def test_trainer_steps_with_fold_equal_fold_off(tiny_model_path, tmp_path, lean, cache, into):
    cfg = dict(fused_lora="on", memory_efficient_ops=lean, cache_lora_casts=cache, accumulate_lora_grads=into,
               learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=True, checkpoint_layer_fraction=0.5,
               micro_batch_tokens=16)
    runs = {mode: _run(tiny_model_path, tmp_path / mode, fold_lora_b=mode, **cfg) for mode in ("off", "on")}
    assert runs["off"][0].folded_lora_layers == 0 and runs["on"][0].folded_lora_layers == 14
    assert_same_training(runs["on"], runs["off"], cfg["learning_rate"], "fold_lora_b")


def test_folded_weights_read_as_the_plain_matrices_and_only_lora_is_saved(tiny_model_path, tmp_path):
    off = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on"))
    on = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fold_lora_b="on"))
    assert_same_model_state(on, off)
    on.save_checkpoint(tmp_path / "ckpt")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)


def test_the_switch_reads_like_the_others_and_is_baked_in(tiny_model_path):
    assert TrainerConfig(fold_lora_b=True).fold_lora_b == "on" and TrainerConfig().fold_lora_b == "auto"
    assert TrainerConfig().enabled("fold_lora_b", True) and not TrainerConfig().enabled("fold_lora_b", False)
    assert TrainerConfig(fused_lora="on", fold_lora_b="on").enabled("fold_lora_b", False)
    assert not TrainerConfig(fused_lora="off", fold_lora_b="on").enabled("fold_lora_b", True)
    assert not TrainerConfig(fold_lora_b="off").enabled("fold_lora_b", True)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fold_lora_b="on"))
    with pytest.raises(ValueError, match="fold_lora_b"):
        trainer.update_config(fold_lora_b="off")


def test_bf16_trainer_steps_with_fold_are_as_close_to_fp32_as_fold_off(tiny_model_path):
    """bf16 on the tiny random model moves gradients by up to ~14% of their scale from fp32 whatever the path; folded,
    each product is rounded once instead of twice (x W^T, then + z (sB)^T), so its error against fp32 is the same
    size as fold off's, tensor by tensor, never a wrong term's."""
    runs = bf16_runs_against_fp32(tiny_model_path, _run, "fold_lora_b")
    assert runs["on"][0].folded_lora_layers == 14


def bf16_runs_against_fp32(tiny_model_path, run, switch: str) -> dict:
    """``run``'s bf16 trainers with ``switch`` off and on, by mode, their gradients checked as close to the float32
    run's as each other (``assert_as_close_to_exact``)."""
    cfg = dict(fused_lora="on", memory_efficient_ops="on", learning_rate=1e-3, micro_batch_tokens=16)
    runs = {mode: run(tiny_model_path, **{switch: mode}, dtype="bfloat16", **cfg) for mode in ("off", "on")}
    exact = run(tiny_model_path, dtype="float32", **cfg)[3]
    assert_as_close_to_exact(runs["on"][3], runs["off"][3], exact)
    return runs


def test_the_docstrings_byte_table_is_what_saved_bytes_computes():
    from backends.training.kernels.fold_lora_b import saved_bytes

    mb = {k: round(v / 1e6, 1) for k, v in saved_bytes(16384, 1536, [8960, 8960], [16, 16]).items()}
    assert mb == {"forward_y_passes": 1174.4, "backward_g_reads": 587.2, "xz_copy": -101.7, "net": 1659.9}
    assert round(28 * saved_bytes(16384, 1536, [8960, 8960], [16, 16])["net"] / 1e9, 1) == 46.5
    assert round(saved_bytes(16384, 1536, [1536], [16])["net"] / 1e6, 1) == 49.8
    assert round(saved_bytes(16384, 1536, [256], [16])["net"] / 1e6, 1) == -76.0
    assert round(saved_bytes(16384, 8960, [1536], [16])["net"] / 1e6, 1) == -436.7


def test_peft_merges_into_and_out_of_a_folded_weight(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fold_lora_b="on", learning_rate=1e-2))
    trainer.train_step(GROUPS)  # B is no longer zero
    ids = torch.tensor([[5, 6, 7, 8, 10, 11]])
    weights = {n: p.detach().clone() for n, p in trainer._lm.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        folded = trainer.model(input_ids=ids).logits
        trainer.model.merge_adapter()  # W += s B A, into the weight as the module holds it
        merged = trainer.model(input_ids=ids).logits
        trainer.model.unmerge_adapter()
        again = trainer.model(input_ids=ids).logits
    torch.testing.assert_close(merged, folded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, folded, rtol=1e-4, atol=1e-5)
    for n, p in trainer._lm.named_parameters():
        if n in weights:
            torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-6, msg=n)
    # peft merged in place: the weights still live in their buffers, so the next forwards run folded
    assert all(m.weight.data_ptr() == m._trajflow_fold.buffer.data_ptr() for m in trainer._lm.modules()
               if isinstance(getattr(m, "_trajflow_fold", None), FoldedWeight))


def test_runs_folded_only_for_the_group_in_its_order_with_fitting_calls():
    gate, up, alone = torch.nn.Linear(6, 10, bias=False), torch.nn.Linear(6, 10, bias=False), torch.nn.Linear(6, 4)
    for m in (gate, up, alone):
        m.weight.requires_grad_(False)
    folds = fold_linears([gate, up], [2, 3])
    (single,) = fold_linears([alone], [2])
    weights, sbs = [gate.weight, up.weight], [torch.zeros(10, 2), torch.zeros(10, 3)]
    assert runs_folded(folds, weights, sbs)
    assert runs_folded([single], [alone.weight], [torch.zeros(4, 2)])
    assert not runs_folded(folds[::-1], weights[::-1], sbs[::-1])  # not the order they were folded in
    assert not runs_folded(folds[:1], weights[:1], sbs[:1])  # a part of a group is not the group
    assert not runs_folded([folds[0], None], weights, sbs)
    assert not runs_folded(folds, weights, [sbs[0], torch.zeros(10, 3, dtype=torch.float64)])  # another dtype
    assert not runs_folded(folds, weights, [sbs[0], torch.zeros(10, 2)])  # another rank
    assert not runs_folded(folds, [gate.weight, up.weight.clone()], sbs)  # a weight that left its buffer
