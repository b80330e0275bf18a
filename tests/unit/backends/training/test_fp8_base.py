"""The frozen base products in FP8 (kernels/fp8_base.py): forward and input grad within fp8's error of fp32 (a wrong
scale layout is O(1) off), LoRA's dA and dB untouched, a trainer step close to fp8 off, and every pass outside the
training micro-batches (KL, probe, evaluation) on the bf16 weights, bit for bit."""

import pytest
import torch

from backends.training.config import TrainerConfig
from backends.training.kernels.fp8_base import Fp8Scope, Fp8Weight, copies_nbytes, quantize_rows
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime, lora_linear
from backends.training.kernels.lean_ops import lora_swiglu
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
FP8_BOUND = 0.08  # relative (Frobenius) error: 1.0-2.2% measured on these ops, 3.7% for a plain 1536^2 e4m3 GEMM


def _weight(g, out_f, in_f):
    """Rows and columns of very different magnitudes: a scale on the wrong axis is O(1) off, not a few percent."""
    w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
    return w * torch.exp(torch.randn(out_f, 1, generator=g)) * torch.exp(torch.randn(1, in_f, generator=g))


def _rel(got, want) -> float:
    return float((got - want).norm() / want.norm())


def _run(x, w, bias, a, b, upstream, fp8: Fp8Weight | None):
    scope = Fp8Scope()
    runtime = LoraRuntime(fp8=scope)
    xi, ai, bi = (t.detach().clone().requires_grad_() for t in (x, a, b))
    with scope.scope():
        out = lora_linear(xi, w, bias, ai, bi, 0.5, runtime=runtime, fp8=fp8)
        (out * upstream).sum().backward()
    return out.detach(), xi.grad, ai.grad, bi.grad, scope


def test_fp8_linear_is_within_fp8_error_of_fp32_and_leaves_the_lora_grads_alone():
    g = torch.Generator().manual_seed(0)
    w, bias = _weight(g, 48, 64), torch.randn(48, generator=g)
    a, b = torch.randn(8, 64, generator=g), torch.randn(48, 8, generator=g)
    x = torch.randn(3, 37, 64, generator=g) * torch.exp(torch.randn(3, 37, 1, generator=g))  # tokens' scales differ
    upstream = torch.randn(3, 37, 48, generator=g)
    exact = _run(x, w, bias, a, b, upstream, None)
    fp8 = Fp8Weight.of(w)
    y, dx, da, db, scope = _run(x, w, bias, a, b, upstream, fp8)
    assert scope.fp8_forwards == 1
    assert 1e-3 < _rel(y, exact[0]) < FP8_BOUND and 1e-3 < _rel(dx, exact[1]) < FP8_BOUND  # fp8 ran, and closely
    # dA = (g sB)^T x and dB = s g^T z read only bf16 x, z and g: the same bits as without fp8
    assert torch.equal(da, exact[2]) and torch.equal(db, exact[3])
    # the bound tells layouts apart: each scale paired with another row's (or column's) values is O(1) off
    swapped = Fp8Weight(fp8.rows, fp8.row_scale.flip(1).contiguous(), fp8.cols, fp8.col_scale.flip(1).contiguous(),
                        fp8.stamp)
    wrong = _run(x, w, bias, a, b, upstream, swapped)
    assert _rel(wrong[0], exact[0]) > 0.3 and _rel(wrong[1], exact[1]) > 0.3


def test_the_copies_keep_their_layouts_and_cost_the_bf16_weights_bytes():
    w = _weight(torch.Generator().manual_seed(1), 32, 80).to(torch.bfloat16)
    fp8 = Fp8Weight.of(w)
    assert fp8.rows.shape == (32, 80) and fp8.row_scale.shape == (1, 32) and fp8.rows.is_contiguous()
    assert fp8.cols.shape == (80, 32) and fp8.col_scale.shape == (1, 80) and fp8.cols.is_contiguous()
    assert fp8.rows.t().stride() == (1, 80)  # the forward's operand b: column-major, as _scaled_mm wants
    assert {fp8.rows.dtype, fp8.cols.dtype} == {torch.float8_e4m3fn} and fp8.row_scale.dtype == torch.float32
    assert fp8.rows.nbytes + fp8.cols.nbytes == w.nbytes
    q, s = quantize_rows(w.float())
    assert float(q.float().abs().max()) == 448.0 and torch.allclose(q.float() * s, w.float(), rtol=0.07, atol=0)


def test_outside_the_scope_or_after_a_write_the_weight_runs_bf16():
    w = torch.randn(16, 16)
    fp8, scope = Fp8Weight.of(w), Fp8Scope()
    assert scope.use(fp8, w, torch.float32) is None  # closed
    with scope.scope():
        assert scope.use(fp8, w, torch.float32).weight is fp8
        assert scope.use(None, w, torch.float32) is None
        w.add_(1.0)  # peft's merge_adapter writes in place: the copies are stale
        assert scope.use(fp8, w, torch.float32) is None
    assert (scope.fp8_forwards, scope.bf16_forwards) == (1, 2)


def test_a_tensor_is_quantized_once_while_unchanged():
    scope, x = Fp8Scope(), torch.randn(8, 32)
    with scope.scope():
        first = scope.quantized(x.reshape(-1, 32))
        assert scope.quantized(x.view(8, 32)) is first  # another view of the same memory, unchanged
        assert scope.quantized(x[:4]) is not first  # other rows
        x.mul_(2.0)
        again = scope.quantized(x.reshape(-1, 32))
    assert again is not first and torch.equal(again[1], first[1] * 2)
    assert (scope.quantizations, scope.reuses) == (3, 1)
    with scope.scope():
        assert scope.quantized(x) is not again  # nothing outlives a scope


def test_fp8_swiglu_is_within_fp8_error_of_fp32():
    g = torch.Generator().manual_seed(2)
    parts = []
    for out_f, in_f in ((64, 32), (64, 32), (32, 64)):
        w = _weight(g, out_f, in_f)
        a, b = torch.randn(4, in_f, generator=g), torch.randn(out_f, 4, generator=g) / 4
        parts.append((w, a, b))
    x, upstream = torch.randn(21, 32, generator=g), torch.randn(21, 32, generator=g)
    runs = []
    for quantized in (False, True):
        scope = Fp8Scope()
        masters = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for _, a, b in parts]
        lora = [LoraParts(w, None, a, b, 0.5, None, Fp8Weight.of(w) if quantized else None)
                for (w, _, _), (a, b) in zip(parts, masters)]
        xi = x.clone().requires_grad_()
        with scope.scope():
            y = lora_swiglu(xi, *lora, runtime=LoraRuntime(fp8=scope))
            (y * upstream).sum().backward()
        runs.append((y.detach(), xi.grad, [t.grad for m in masters for t in m], scope.fp8_forwards))
    (y0, dx0, grads0, n0), (y1, dx1, grads1, n1) = runs
    assert (n0, n1) == (0, 3)
    assert 1e-3 < _rel(y1, y0) < FP8_BOUND and 1e-3 < _rel(dx1, dx0) < FP8_BOUND
    assert all(_rel(got, want) < 2 * FP8_BOUND for got, want in zip(grads1, grads0))


def _trainer(tiny_model_path, fp8: str, **cfg):
    return GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="on", fp8_base=fp8, **cfg))


@pytest.mark.parametrize("lean", ["on", "off"])
def test_a_trainer_step_with_fp8_is_close_to_fp8_off_and_its_other_passes_are_bf16(tiny_model_path, lean):
    cfg = dict(memory_efficient_ops=lean, learning_rate=1e-3, kl_coef=0.2, micro_batch_tokens=16)
    on, off = _trainer(tiny_model_path, "on", **cfg), _trainer(tiny_model_path, "off", **cfg)
    assert on.fp8_lora_layers == 14 and off.fp8_lora_layers == 0 and on.folded_lora_layers == 0
    quantized = [m.weight for m in on._lm.modules() if getattr(m, "_trajflow_fp8", None) is not None]
    # two 1-byte copies (a bf16 weight's bytes) and a float32 scale per row and per column
    assert copies_nbytes(on._lm) == sum(2 * w.numel() + 4 * sum(w.shape) for w in quantized)
    prompt, completion = [5, 6, 7, 8], [10, 11, 12]
    before = on.fp8.fp8_forwards
    # before any step both adapters are the same: the probe's passes must be the bf16 ones, bit for bit
    assert on.sequence_logprobs(prompt, completion) == off.sequence_logprobs(prompt, completion)
    assert on.greedy_tokens(prompt, 6) == off.greedy_tokens(prompt, 6)
    assert on.fp8.fp8_forwards == before and on.fp8.bf16_forwards > 0
    quantized = on.fp8.quantizations
    m_on, m_off = on.train_step(GROUPS), off.train_step(GROUPS)
    assert on.fp8.fp8_forwards > before and on.fp8.quantizations > quantized
    assert on.fp8.reuses == on.fp8.fp8_forwards * 3 // 7  # k, v read q's x_q and up gate's: 4 forward quantizations
    assert m_on["kl_policy_ref"] == m_off["kl_policy_ref"]  # the KL passes ran bf16 (same adapter at step 0)
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=0.05, abs=1e-3)
    assert m_on["mismatch_kl"] != m_off["mismatch_kl"]  # computed from the fp8 forward
    assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=0.1)


def test_fp8_on_refuses_where_it_cannot_run(tiny_model_path, monkeypatch):
    with pytest.raises(ValueError, match="fp8_base 'on' needs the fused LoRA ops"):
        GRPOTrainer(str(tiny_model_path), TrainerConfig(fused_lora="off", fp8_base="on"))
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(RuntimeError, match=r"torch._scaled_mm.*on cpu"):
        _trainer(tiny_model_path, "on")
    assert _trainer(tiny_model_path, "off").fp8 is None  # off never looks for it


def test_the_switch_is_opt_in_turns_fold_off_and_is_baked_in(tiny_model_path):
    assert TrainerConfig().fp8_base == "off" and TrainerConfig(fp8_base=True).fp8_base == "on"
    assert not TrainerConfig(fp8_base="auto").enabled("fp8_base", True)  # 'auto' is off: slower and inexact on the H200
    assert TrainerConfig(fp8_base="on").enabled("fp8_base", True)
    assert not TrainerConfig(fp8_base="on").enabled("fp8_base", False)  # fused_lora 'auto' is off on the CPU
    assert not TrainerConfig(fp8_base="on").enabled("fold_lora_b", True)
    assert TrainerConfig(fp8_base="auto").enabled("fold_lora_b", True)
    trainer = _trainer(tiny_model_path, "on", fold_lora_b="on")
    assert trainer.folded_lora_layers == 0 and trainer.fp8_lora_layers == 14
    with pytest.raises(ValueError, match="fp8_base"):
        trainer.update_config(fp8_base="off")
