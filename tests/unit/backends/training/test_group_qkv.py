"""q, k and v as one LoRA product (kernels/group_qkv.py): the same function and gradients as the per-module fused ops,
the base weights held once, nothing handed over stale, and the switch acting only with fused_lora."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fold_lora_b import FoldedWeight
from backends.training.kernels.fused_lora import LoraRuntime, fusable_parts, patch_lora
from backends.training.kernels.group_qkv import PROJECTIONS, group_model, grouped_layers
from backends.training.kernels.lora_cast_cache import CastCache
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import (
    assert_as_close_to_exact,
    assert_same_adam_updates,
    assert_same_model_state,
    record_gradients,
    synthetic_group,
)

pytestmark = pytest.mark.usefixtures("single_thread")

# rows of 6 to 10 tokens, two or more packed into each 16-token micro-batch
GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0], prompt=(5, 6, 7, 8, 9))]
CFG = dict(fused_lora="on", learning_rate=1e-3, kl_coef=0.2, micro_batch_tokens=16)


def _attentions(trainer):
    return [m for m in trainer._lm.modules() if all(hasattr(m, n) for n in PROJECTIONS)]


def _count_grouped_calls(trainer) -> list[int]:
    """A counter of the grouped op's runs (wrapping each group's ``_grouped``)."""
    calls = [0]
    for group in grouped_layers(trainer._lm):
        inner = group._grouped

        def counted(x, inner=inner):
            out = inner(x)
            calls[0] += out is not None
            return out

        group._grouped = counted
    return calls


def _run(tiny_model_path, **cfg):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**cfg))
    calls = _count_grouped_calls(trainer)
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(GROUPS) for _ in range(2)]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return trainer, metrics, weights, grads, calls[0]


@pytest.mark.parametrize("lean,cache,into,fold", [("on", "on", "on", "auto"), ("off", "off", "off", "on"),
                                                  ("on", "on", "off", "off"), ("off", "off", "on", "on")])
def test_trainer_steps_with_group_qkv_equal_group_off(tiny_model_path, lean, cache, into, fold):
    cfg = dict(CFG, memory_efficient_ops=lean, cache_lora_casts=cache, accumulate_lora_grads=into, fold_lora_b=fold,
               gradient_checkpointing=True, checkpoint_layer_fraction=0.5)
    runs = {mode: _run(tiny_model_path, group_qkv=mode, **cfg) for mode in ("off", "on")}
    on, off = runs["on"][0], runs["off"][0]
    assert off.grouped_qkv_layers == 0 and on.grouped_qkv_layers == 2 and on.packed  # rows packed in a micro-batch
    # per micro-batch: forward, the checkpointed layer's recompute, the KL pass; none fell back
    assert runs["on"][4] >= 2 * runs["on"][1][0]["micro_batches"] and runs["off"][4] == 0
    if fold == "on":  # q, k, v are grouped, not also folded alone: 2 layers x (o, gate, up, down)
        assert on.folded_lora_layers == 8 and off.folded_lora_layers == 14
    for step, (ours, ref) in enumerate(zip(runs["on"][1], runs["off"][1])):
        for key in ("loss", "grad_norm", "entropy", "kl_policy_ref", "mismatch_kl"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (step, key)
    assert runs["on"][1][0]["micro_batches"] >= 2 and runs["on"][1][1]["kl_policy_ref"] != 0.0
    assert len(runs["on"][3]) == len(runs["off"][3]) == 2
    for step, (got, want) in enumerate(zip(runs["on"][3], runs["off"][3])):  # within 1e-5 of each tensor's scale
        assert got.keys() == want.keys()
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=0, atol=1e-5 * float(ref.abs().max()), msg=f"{step} {name}")
    assert_same_adam_updates(runs["on"][2], runs["off"][2], cfg["learning_rate"], 2, "group_qkv")
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    assert on.sequence_logprobs(prompt, completion) == pytest.approx(off.sequence_logprobs(prompt, completion),
                                                                      rel=1e-5, abs=1e-6)


def test_bf16_steps_grouped_are_as_close_to_fp32_as_ungrouped(tiny_model_path):
    """bf16 on the CPU (no autocast: the weights' dtype) runs grouped too; each of q, k, v is rounded once instead of
    twice (x W^T, then + z (sB)^T), so its gradients' error against fp32 is the size of group_qkv off's."""
    cfg = dict(CFG, memory_efficient_ops="on")
    runs = {mode: _run(tiny_model_path, group_qkv=mode, dtype="bfloat16", **cfg) for mode in ("off", "on")}
    exact = _run(tiny_model_path, dtype="float32", **cfg)[3]
    assert runs["on"][4] > 0 and runs["on"][0].grouped_qkv_layers == 2  # the grouped op ran in bf16
    assert_as_close_to_exact(runs["on"][3], runs["off"][3], exact)


def test_the_base_weights_are_held_once_and_read_as_the_plain_matrices(tiny_model_path):
    off = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on"))
    on = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", group_qkv="on"))
    assert_same_model_state(on, off)
    groups = grouped_layers(on._lm)
    assert len(groups) == on.grouped_qkv_layers == 2
    for group, attention in zip(groups, _attentions(on)):
        bases = [getattr(attention, n).base_layer for n in PROJECTIONS]
        assert group.modules == [getattr(attention, n) for n in PROJECTIONS]
        in_f, rank = bases[0].weight.shape[1], 3 * on.config.lora_rank
        assert group.weight.shape == (sum(b.weight.shape[0] for b in bases), in_f + rank)
        row = 0
        for base in bases:  # each weight and bias is a view of the one buffer: no second copy
            assert isinstance(base._trajflow_fold, FoldedWeight) and not base.weight.requires_grad
            assert base.weight.data_ptr() == group.weight[row].data_ptr() and base.weight.shape[1] == in_f
            if base.bias is not None:
                assert base.bias.data_ptr() == group.bias[row].data_ptr() and not base.bias.requires_grad
            row += base.weight.shape[0]
        held = {t.untyped_storage().data_ptr() for b in bases for t in (b.weight, b.bias) if t is not None}
        assert held == {group.weight.untyped_storage().data_ptr()} | (
            set() if group.bias is None else {group.bias.untyped_storage().data_ptr()})
    weight_bytes = sum(g.weight.numel() * g.weight.element_size() for g in groups)
    plain = sum(getattr(a, n).base_layer.weight.numel() * 4 for a in _attentions(off) for n in PROJECTIONS)
    rank_cols = sum(g.weight.shape[0] * 3 * on.config.lora_rank * 4 for g in groups)
    assert weight_bytes == plain + rank_cols  # the weights once, plus the sB columns


def test_k_proj_on_another_x_computes_its_own_output(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", group_qkv="on", learning_rate=1e-2))
    trainer.train_step(GROUPS)  # B is no longer zero
    attention = _attentions(trainer)[0]
    q, k, v = (getattr(attention, n) for n in PROJECTIONS)
    hidden = trainer._lm.config.hidden_size
    g = torch.Generator().manual_seed(0)
    x, other = torch.randn(1, 5, hidden, generator=g), torch.randn(1, 5, hidden, generator=g)

    def alone(module, t):
        return module._trajflow_ungrouped_forward(t)

    q(x)
    torch.testing.assert_close(k(other), alone(k, other))  # not x: computed alone, not k(x)
    torch.testing.assert_close(v(x), alone(v, x))  # the hand-over was dropped: still right
    assert q._trajflow_qkv._pending is None
    q(x)
    torch.testing.assert_close(k(x), alone(k, x), rtol=1e-5, atol=1e-6)  # handed over
    x.add_(1.0)  # x changed in place since q_proj read it: v computes on what x is now
    torch.testing.assert_close(v(x), alone(v, x))
    q(x)
    q(other)  # the next q_proj call drops the last hand-over
    torch.testing.assert_close(k(x), alone(k, x))
    with trainer.model.disable_adapter():  # the base model: peft's path, nothing grouped
        want = torch.nn.functional.linear(x, q.base_layer.weight, q.base_layer.bias)
        torch.testing.assert_close(q(x), want)
        torch.testing.assert_close(k(x), torch.nn.functional.linear(x, k.base_layer.weight, k.base_layer.bias))
        assert q._trajflow_qkv._pending is None


def test_another_compute_dtype_runs_each_module_alone(tiny_model_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", group_qkv="on"))
    calls = _count_grouped_calls(trainer)
    attention = _attentions(trainer)[0]
    x = torch.randn(1, 4, trainer._lm.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        outs = [getattr(attention, n)(x) for n in PROJECTIONS]
    assert calls[0] == 0 and all(o.dtype == torch.float64 for o in outs)


def test_the_switch_acts_only_with_fused_lora_and_is_baked_in(tiny_model_path):
    assert TrainerConfig().group_qkv == "off" and TrainerConfig(group_qkv=True).group_qkv == "on"
    assert not TrainerConfig(group_qkv="auto").enabled("group_qkv", True)  # 'auto' is off until measured
    assert TrainerConfig(group_qkv="on").enabled("group_qkv", True)
    assert not TrainerConfig(group_qkv="on").enabled("group_qkv", False)  # fused_lora 'auto' is off on the CPU
    assert not TrainerConfig(group_qkv="on", fused_lora="on", fp8_base="on").enabled("group_qkv", False)
    plain = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="off", group_qkv="on"))
    assert plain.grouped_qkv_layers == 0 and not grouped_layers(plain._lm)
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", group_qkv="on"))
    with pytest.raises(ValueError, match="group_qkv"):
        trainer.update_config(group_qkv="off")


def _attention_layer(family: str, grouped: bool, ranks=None, into_masters: bool = True):
    """One attention layer of a 1-layer ``family`` model with LoRA on q, k, v, o (B random, so every term counts), its
    projections patched fused; grouped or not. ``ranks``: per-module ranks (peft's rank_pattern)."""
    import importlib

    from peft import LoraConfig, get_peft_model

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral"}[family]
    cfg = getattr(modeling, f"{prefix}Config")(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                               head_dim=16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = get_peft_model(getattr(modeling, f"{prefix}ForCausalLM")(cfg), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], rank_pattern=ranks or {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    cache = CastCache()
    patch_lora(model, LoraRuntime(cache, into_masters))
    lm = model.get_base_model()
    if grouped:
        assert group_model(lm, fusable_parts) == 1
    return model, lm.model.layers[0].self_attn, cache


def _cos_sin(length: int, dim: int = 16):
    freqs = torch.arange(length).float()[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
def test_each_family_s_attention_equals_its_ungrouped_one(family):
    ranks = {"k_proj": 4, "v_proj": 12}  # R is the sum of unequal ranks
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=g)
    runs = {}
    for grouped in (False, True):
        model, attention, _ = _attention_layer(family, grouped, ranks)
        calls = [0]
        if grouped:
            group = attention.q_proj._trajflow_qkv
            assert (group.bias is None) == (family != "qwen2")  # Qwen2's q, k, v have biases
            inner = group._grouped
            group._grouped = lambda t: calls.__setitem__(0, calls[0] + 1) or inner(t)
        xi = x.clone().requires_grad_()
        out, _ = attention(xi, _cos_sin(7), None)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[grouped] = out.detach(), xi.grad, grads, calls[0]
    assert runs[True][3] == 1
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-5, atol=1e-6)
    assert runs[True][2].keys() == runs[False][2].keys() and len(runs[True][2]) == 8
    for name, want in runs[False][2].items():
        torch.testing.assert_close(runs[True][2][name], want, rtol=0, atol=1e-5 * float(want.abs().max()), msg=name)


@pytest.mark.parametrize("into_masters", [True, False], ids=["into-masters", "autograd"])
def test_a_grouped_layer_runs_fewer_ops(into_masters, monkeypatch):
    """The computing aten ops of one Qwen2 attention layer's forward and backward with fused_rope (its kernel counted
    as one op), a later micro-batch (casts cached, .grad there): q, k, v's forward 9 -> 4 (cat A, x A^T, cat [x | z],
    one addmm), backward 8 fewer (one cat of g, g W_qkv and dz A instead of three g (sB), g W, gz A, and autograd's
    two dx adds). Into the masters (the CUDA defaults) the layer runs 41 ops -> 28."""
    from backends.training.kernels import fused_rope
    from tests.unit.backends.training.test_fused_rope import _AtenCounter

    counted = {}
    for grouped in (False, True):
        model, attention, cache = _attention_layer("qwen2", grouped, into_masters=into_masters)
        fused_rope.patch_model(model)
        x0, rope = torch.randn(1, 9, 64, requires_grad=True), _cos_sin(9)
        counter = _AtenCounter()
        monkeypatch.setattr(fused_rope, "kernel", counter.as_one_op)
        with cache.scope():
            attention(x0, rope, None)[0].sum().backward()  # the step's first micro-batch: casts, .grad made
            counter.ops.clear()
            with counter:
                out, _ = attention(x0, rope, None)
                forward = list(counter.ops)
                out.sum().backward()
        counted[grouped] = forward, counter.ops[len(forward):]
    (off_fwd, off_bwd), (on_fwd, on_bwd) = counted[False], counted[True]
    assert len(on_fwd) == len(off_fwd) - 5, (off_fwd, on_fwd)
    assert len(on_bwd) == len(off_bwd) - 8, (off_bwd, on_bwd)
    if into_masters:
        assert (len(off_fwd) + len(off_bwd), len(on_fwd) + len(on_bwd)) == (41, 28)
