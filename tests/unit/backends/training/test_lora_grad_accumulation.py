"""LoRA weight gradients added straight into the fp32 masters' .grad (kernels/lora_grad_accumulation.py): the same
gradients as autograd's accumulation over several micro-batches, with fewer kernels per micro-batch."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.training.config import TrainerConfig
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime, lora_linear
from backends.training.kernels.lean_ops import lora_swiglu
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import assert_same_gradients, record_gradients, step_rows, synthetic_group

pytestmark = pytest.mark.usefixtures("single_thread")

GROUPS = [synthetic_group([0.0, 1.0, 0.25]), synthetic_group([2.0, 0.0])]
FUSED = dict(fused_lora="on", micro_batch_tokens=8, learning_rate=1e-2)
INTO = LoraRuntime(grads_into_masters=True)


class OpCounts(TorchDispatchMode):
    """How many times each aten op runs inside the block (CPU: each is one kernel)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _masters(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_gradients_accumulated_into_masters_equal_autograds_over_micro_batches(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 12, generator=g).to(dtype)
    xs = [torch.randn(5, 12, generator=g).to(dtype) for _ in range(3)]
    ups = [torch.randn(5, 7, generator=g).to(dtype) for _ in range(3)]
    grads = {}
    for runtime in (LoraRuntime(), INTO):
        a, b = _masters(1, [(4, 12), (7, 4)])
        for x, up in zip(xs, ups):  # three micro-batches, one backward each
            (lora_linear(x, w, None, a, b, 0.5, runtime=runtime).float() * up.float()).sum().backward()
        grads[runtime.grads_into_masters] = (a.grad, b.grad)
    for got, want in zip(grads[True], grads[False]):
        assert got.dtype == torch.float32
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: autograd's path rounds each product to bf16 first
        assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_swiglu_gradients_accumulated_into_masters_equal_autograds():
    g = torch.Generator().manual_seed(2)
    hidden, inter, r = 6, 10, 3
    ws = [torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g),
          torch.randn(hidden, inter, generator=g)]
    x = torch.randn(4, hidden, generator=g, requires_grad=True)
    up = torch.randn(4, hidden, generator=g)
    grads = {}
    for runtime in (LoraRuntime(), INTO):
        ms = _masters(3, [(r, hidden), (inter, r), (r, hidden), (inter, r), (r, inter), (hidden, r)])
        parts = [LoraParts(w, None, ms[2 * i], ms[2 * i + 1], 0.5) for i, w in enumerate(ws)]
        for _ in range(2):
            (lora_swiglu(x, *parts, runtime=runtime) * up).sum().backward()
        grads[runtime.grads_into_masters] = [m.grad for m in ms]
    for got, want in zip(grads[True], grads[False]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_gradients_accumulated_both_ways_agree(tiny_model_path, dtype):
    runs = {}
    for mode in ("off", "on"):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**FUSED, dtype=dtype, accumulate_lora_grads=mode,
                                                                  memory_efficient_ops="on"))
        grads = record_gradients(trainer)
        metrics = [trainer.train_step(GROUPS) for _ in range(2)]
        assert metrics[0]["micro_batches"] >= 3
        runs[mode] = (metrics, grads)
    if dtype == "float32":
        assert_same_gradients(runs["on"][1], runs["off"][1], "gradients into the masters")
    else:  # products kept in fp32 instead of rounded to bf16 first: equal within bf16 rounding
        for got, want in zip(runs["on"][1], runs["off"][1]):
            for k in want:
                assert torch.allclose(got[k], want[k], rtol=2e-2, atol=2e-2 * want[k].abs().max().item()), k
    for got, want in zip(runs["on"][0], runs["off"][0]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2)


def _micro_batch_ops(trainer) -> collections.Counter:
    """aten ops of one micro-batch's forward + backward after the step's first (the cache filled, .grad made)."""
    batches = trainer.micro_batches(step_rows(GROUPS))
    with trainer.lora_casts_scope():
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer._micro_batch_step(batches[0], 0.2, 0.2)
        with OpCounts() as ops:
            trainer._micro_batch_step(batches[0], 0.2, 0.2)
    trainer.optimizer.zero_grad(set_to_none=True)
    return ops.counts


def test_each_switch_removes_its_kernels_per_micro_batch(tiny_model_path):
    """bf16 compute on the CPU, 14 fused LoRA linears (no lean MLP): per micro-batch the cache removes 3 ops per
    module (cast of A, s*B, its cast), the accumulation 5 (two casts, the scaling, autograd's two adds) for 1 (the
    bf16 product added into fp32 .grad: the CPU has no fp32-output addmm, so one add_ per product is left)."""
    counts = {}
    for cache, into in (("off", "off"), ("on", "off"), ("on", "on")):
        trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(**FUSED, dtype="bfloat16", cache_lora_casts=cache,
                                                                  accumulate_lora_grads=into))
        counts[cache, into] = _micro_batch_ops(trainer)
    base, cached, both = counts["off", "off"], counts["on", "off"], counts["on", "on"]
    modules = 14
    assert base["_to_copy"] - cached["_to_copy"] == 2 * modules and base["mul"] - cached["mul"] == modules
    assert cached["_to_copy"] - both["_to_copy"] == 2 * modules  # dL/dA, dL/dB no longer cast to fp32
    assert cached["mul_"] - both["mul_"] == modules  # nor dL/dB scaled apart
    # autograd's two accumulating adds per module become one add_ per product, cast and scaled in it
    assert cached["add_"] + cached["add"] - (both["add_"] + both["add"]) == 0
    assert cached["mm"] == both["mm"]
    assert sum(base.values()) - sum(both.values()) == 3 * modules + 3 * modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_grad_ignores_its_uninitialised_memory(monkeypatch, dtype):
    """The first micro-batch's .grad is allocated, not zeroed: beta 0 (or the zero fill of the fallback) must leave no
    trace of what the memory held."""
    from backends.training.kernels import lora_grad_accumulation as acc

    monkeypatch.setattr(acc.torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.zeros(3, 5))
    m1, m2 = torch.randn(7, 3, generator=g).to(dtype), torch.randn(7, 5, generator=g).to(dtype)
    acc.accumulate(p, m1.t(), m2, alpha=0.5)
    acc.accumulate(p, m1.t(), m2, alpha=0.5)
    want = m1.t().float() @ m2.float()
    assert p.grad.dtype == torch.float32 and torch.allclose(p.grad, want, rtol=1e-2, atol=1e-2)
