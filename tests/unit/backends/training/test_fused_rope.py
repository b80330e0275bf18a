"""fused_rope: the one-op rotary embedding against transformers' apply_rotary_pos_emb (forward, backward, layout), the
guard against a changed transformers, the aten ops a layer runs with and without it, and a trainer step on vs off
(CPU, eager kernels)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen2 import modeling_qwen2

from backends.training.config import TrainerConfig
from backends.training.kernels import fused_rope as fr
from backends.training.packed_attention import PackedAttention, RowSpans, install_varlen_attention
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import assert_same_gradients, record_gradients, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")


def _qk_cos_sin(dtype, heads=4, kv_heads=2, length=9, dim=16, requires_grad=False):
    """q, k as q_proj/k_proj leave them ([1, L, H, D] memory seen as [1, H, L, D]); cos, sin as Qwen2's rotary
    embedding makes them for position ids restarting at 0 in each of two packed rows."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, length, heads, dim, generator=g).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(1, length, kv_heads, dim, generator=g).to(dtype).requires_grad_(requires_grad)
    positions = torch.cat([torch.arange(5), torch.arange(length - 5)]).float()
    freqs = positions[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def test_forward_is_stock_bit_for_bit_in_fp32_and_keeps_q_projs_layout():
    q, k, cos, sin = _qk_cos_sin(torch.float32)
    want = modeling_qwen2.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got = fr.fused_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
        assert a.transpose(1, 2).is_contiguous()  # [1, L, H, D] memory: packed attention reads it without a copy


def test_forward_in_bf16_is_within_bf16_rounding_of_stock():
    q, k, cos, sin = _qk_cos_sin(torch.bfloat16)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    got = fr.fused_rope(q, k, cos, sin)
    stock = modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin)
    exact = fr.fused_rope(q.double(), k.double(), cos.double(), sin.double())
    # |x cos| + |R(x) sin|: the size of the terms stock rounds to bf16 before their sum
    c, s = cos.double().abs().unsqueeze(1), sin.double().abs().unsqueeze(1)
    terms = [x.double().abs() * c + modeling_qwen2.rotate_half(x.double()).abs() * s for x in (q, k)]
    for ours, theirs, ref, size in zip(got, stock, exact, terms):
        assert ours.dtype == torch.bfloat16
        assert ((ours.double() - ref).abs() <= ref.abs() * 2**-8).all()  # rounded once: half a bf16 ulp
        assert ((theirs.double() - ours.double()).abs() <= size * 2**-7).all()  # stock rounds each term, then sums


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_backward_equals_autograd_of_stock(unsqueeze_dim):
    q, k, cos, sin = _qk_cos_sin(torch.float32, requires_grad=True)
    view = (lambda x: x.transpose(1, 2)) if unsqueeze_dim == 1 else (lambda x: x)
    g = torch.Generator().manual_seed(1)
    up_q, up_k = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    grads = {}
    for name, fn in (("stock", modeling_qwen2.apply_rotary_pos_emb), ("fused", fr.fused_rope)):
        q2, k2 = fn(view(q), view(k), cos, sin, unsqueeze_dim=unsqueeze_dim)
        loss = (view(q2) * up_q).sum() + (view(k2) * up_k).sum()
        grads[name] = torch.autograd.grad(loss, (q, k))
    for a, b in zip(grads["fused"], grads["stock"]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_guard_refuses_a_changed_signature_or_formula(monkeypatch):
    fr.check_stock_rope(modeling_qwen2.apply_rotary_pos_emb)  # the installed transformers passes

    def with_position_ids(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    for changed in (with_position_ids, interleaved):
        with pytest.raises(RuntimeError, match="fused_rope to 'off'"):
            fr.check_stock_rope(changed)
    # and a patch of a model whose modeling module's function changed fails at set-up, not in a step
    model = modeling_qwen2.Qwen2Model(modeling_qwen2.Qwen2Config(hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=1, num_attention_heads=4,
                                                                 num_key_value_heads=2, vocab_size=50))
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", with_position_ids)
    fr._fused_forward.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="fused_rope to 'off'"):
            fr.patch_model(model)
    finally:
        fr._fused_forward.cache_clear()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_patch_is_scoped_to_the_patched_modules(family):
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config_class, model_class = (getattr(modeling, f"{family.capitalize()}{n}") for n in ("Config", "Model"))
    cfg = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=50)
    torch.manual_seed(0)
    patched, stock = model_class(cfg), model_class(cfg)
    stock.load_state_dict(patched.state_dict())
    assert fr.patch_model(patched) == 2
    assert modeling.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"  # the module's own is untouched
    assert "forward" not in vars(stock.layers[0].self_attn)
    ids = torch.randint(0, 50, (1, 11))
    assert torch.equal(patched(ids).last_hidden_state, stock(ids).last_hidden_state)


class _AtenCounter(TorchDispatchMode):
    """The aten ops that compute (views left out); a call of a ``kernel`` function counts as ONE op, the compiled
    kernel it is on CUDA, whatever it runs eagerly here."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def as_one_op(self, fn, compile):
        def run(*args):
            self.ops.append(fn.__name__)
            self.paused = True
            try:
                return fn(*args)
            finally:
                self.paused = False
        return run


def attention_ops(fused: bool, monkeypatch, heads=4, kv_heads=2, packed=None) -> tuple[list[str], list[str]]:
    """The computing aten ops of one Qwen2 attention layer's forward and backward (fp32, CPU), fused_rope on or off;
    SDPA, or with ``packed`` (a ``PackedAttention``) the packed attention."""
    cfg = modeling_qwen2.Qwen2Config(hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=50)
    cfg._attn_implementation = "sdpa"
    attn = modeling_qwen2.Qwen2Attention(cfg, 0)
    kwargs = {}
    if packed is not None:
        install_varlen_attention(modeling_qwen2.Qwen2ForCausalLM(cfg))
        kwargs["trajflow_packed"] = packed
    if fused:
        fr.patch_model(attn)
    x = torch.randn(1, 9, cfg.hidden_size, requires_grad=True)
    _, _, cos, sin = _qk_cos_sin(torch.float32, dim=16)
    counter = _AtenCounter()
    monkeypatch.setattr(fr, "kernel", counter.as_one_op)
    with counter:
        out, _ = attn(x, (cos, sin), None, **kwargs)
        forward = list(counter.ops)
        out.sum().backward()
    return forward, counter.ops[len(forward):]


def test_fused_rope_cuts_the_ops_of_an_attention_layer(monkeypatch):
    (stock_fwd, stock_bwd), (fused_fwd, fused_bwd) = (attention_ops(f, monkeypatch) for f in (False, True))
    # stock rotary per tensor: mul, neg, cat, mul, add forward; backward more. Fused: one kernel call each way
    assert fused_fwd.count("_rotate_pair") == 1 and fused_bwd.count("_rotate_grad_pair") == 1
    assert len(fused_fwd) <= len(stock_fwd) - 9 and len(fused_bwd) <= len(stock_bwd) - 9, (
        (len(stock_fwd), len(stock_bwd)), (len(fused_fwd), len(fused_bwd)))


@pytest.mark.parametrize("bucket", [1, 4])
def test_a_packed_layer_with_fused_rope_copies_nothing_in_backward(monkeypatch, bucket):
    """q, k and v's gradients reach the projections in their layout: no zero-filled index backward, no clone, no
    unpadding copy. The one copy a padded row makes in backward is its output gradient's, into the padded buffer
    SDPA's backward reads (``_CutRows``), one per row at bucket 4 (the 4-token row too: a fresh buffer either way)."""
    packed = PackedAttention(RowSpans.of([5, 4], "cpu"), "rows", None, bucket)
    _, backward = attention_ops(True, monkeypatch, packed=packed)
    unwanted = {"aten.select_backward", "aten.slice_backward", "aten.clone", "aten.zeros", "aten.constant_pad_nd"}
    assert not unwanted & set(backward), backward
    assert backward.count("aten.copy_") == backward.count("aten.new_empty") == (2 if bucket > 1 else 0), backward


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_step_fused_rope_on_equals_off(tiny_model_path, monkeypatch, checkpointing):
    calls = []
    real = fr._FusedRope.apply
    # cos at position 0 is all ones: how many packed rows start in this micro-batch
    monkeypatch.setattr(fr._FusedRope, "apply", lambda *a: calls.append(int((a[2][0] == 1).all(-1).sum())) or real(*a))
    # rows of 3 + 3 + 3 (+ 2) tokens packed into one micro-batch: position ids restart at 0 in each row
    groups = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0], prompt=(5, 6, 7, 8, 9))]
    cfg = dict(learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=checkpointing)
    runs = {}
    for rope in ("off", "on"):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_rope=rope, **cfg))
        grads = record_gradients(trainer)
        runs[rope] = (trainer, trainer.train_step(groups), grads)
    assert runs["off"][0].fused_rope_layers == 0 and runs["on"][0].fused_rope_layers == 2
    assert calls and max(calls) > 1  # the 'on' trainer's layers ran the op, on micro-batches of several rows
    for key in ("loss", "grad_norm", "entropy", "kl_policy_ref"):
        assert runs["on"][1][key] == pytest.approx(runs["off"][1][key], rel=1e-5, abs=1e-7), key
    assert_same_gradients(runs["on"][2], runs["off"][2], "fused_rope on vs off")


def test_auto_follows_memory_efficient_ops():
    assert fr.enabled("auto", True) and not fr.enabled("auto", False)
    assert fr.enabled("on", False) and not fr.enabled("off", True)
    assert TrainerConfig().fused_rope == "auto" and TrainerConfig(fused_rope=False).fused_rope == "off"
