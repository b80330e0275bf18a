"""The Triton kernels of ``swiglu_lora_triton`` under the Triton interpreter, in float32 (the interpreter computes
bfloat16 wrongly): each against the torch formulas, and the lean SwiGLU op with them against the op without them.

Not collected by itself: ``test_swiglu_lora_triton.py`` runs this file in a subprocess with TRITON_INTERPRET=1, which
must be set before triton is imported (other tests of a worker may import it through torch.compile)."""

import contextlib
import dataclasses
import json
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from backends.training.kernels import lean_ops, swiglu_lora_triton  # noqa: E402
from backends.training.kernels.fold_lora_a import fold_rows  # noqa: E402
from backends.training.kernels.fold_lora_b import fold_linears  # noqa: E402
from backends.training.kernels.fused_lora import LoraParts  # noqa: E402
from backends.training.kernels.recompute_norm import NormSource, mark  # noqa: E402
from tests.unit.backends.training.test_fold_lora_b import (  # noqa: E402
    RUNTIMES,
    _linear,
    _masters,
    assert_same_training,
    train,
)

RUNTIME_IDS = ["autograd", "into-masters", "cached+into-masters"]
# rows and columns that are not multiples of the blocks (64 x 128); 96-row splits: several, one of them partial
ROWS, HIDDEN, INTER, RANK = 150, 24, 200, 16


@pytest.fixture(autouse=True)
def float32_runs(monkeypatch):
    monkeypatch.setattr(swiglu_lora_triton, "DTYPES", (torch.float32,))
    monkeypatch.setattr(swiglu_lora_triton, "_SPLIT_ROWS", 96)


@pytest.fixture
def calls(monkeypatch):
    """How many times the kernel ran."""
    counts = {"backward": 0}
    for name in counts:
        inner = getattr(swiglu_lora_triton, name)

        def counted(*args, _inner=inner, _name=name):
            counts[_name] += 1
            return _inner(*args)

        monkeypatch.setattr(swiglu_lora_triton, name, counted)
    return counts


def _close(got, want, name):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=name)


def test_backward_is_the_silu_gradients_and_three_sums_over_tokens():
    g = torch.Generator().manual_seed(1)
    dh, gate, up = (torch.randn(ROWS, INTER, generator=g) for _ in range(3))
    # the z's as the folded op has them: column slices of a wider buffer (row stride > r)
    wide = torch.randn(ROWS, HIDDEN + 2 * RANK, generator=g)
    z_gate, z_up = wide[:, HIDDEN:HIDDEN + RANK], wide[:, HIDDEN + RANK:]
    gz_down = torch.randn(ROWS, RANK, generator=g)
    grad_g, grad_u, sums = swiglu_lora_triton.backward(dh, gate, up, z_gate, z_up, gz_down)
    want_g, want_u = lean_ops._silu_mul_grads(dh, gate, up)
    _close(grad_g, want_g, "grad_g")
    _close(grad_u, want_u, "grad_u")
    assert sums.shape == (3, RANK, INTER) and sums.dtype == torch.float32
    _close(sums[0], z_gate.t() @ want_g, "z_gate^T grad_g")
    _close(sums[1], z_up.t() @ want_u, "z_up^T grad_u")
    _close(sums[2], gz_down.t() @ (F.silu(gate) * up), "gz_down^T h")
    again = swiglu_lora_triton.backward(dh, gate, up, z_gate, z_up, gz_down)
    assert all(torch.equal(a, b) for a, b in zip(again, (grad_g, grad_u, sums)))  # no atomics: the same bits


def test_in_float16_the_products_take_the_rounded_tiles():
    """The interpreter computes float16 (not bfloat16) right: the gradients are the torch formulas rounded once
    (within an ulp), and the sums are products of the rounded values (h rounded as the forward rounds it; the products
    of the unrounded ones are several float16 ulps away here)."""
    g = torch.Generator().manual_seed(4)
    dh, gate, up = (torch.randn(ROWS, INTER, generator=g).half() for _ in range(3))
    z_gate, z_up, gz_down = (torch.randn(ROWS, RANK, generator=g).half() for _ in range(3))
    exact = F.silu(gate.float()) * up.float()
    h = exact.half()
    grad_g, grad_u, sums = swiglu_lora_triton.backward(dh, gate, up, z_gate, z_up, gz_down)
    want_g, want_u = lean_ops._silu_mul_grads(dh, gate, up)
    torch.testing.assert_close(grad_g, want_g, rtol=1e-3, atol=0)  # an ulp: the float32 sums in another order
    torch.testing.assert_close(grad_u, want_u, rtol=1e-3, atol=0)
    for got, left, right in ((sums[0], z_gate, grad_g), (sums[1], z_up, grad_u), (sums[2], gz_down, h)):
        torch.testing.assert_close(got, left.float().t() @ right.float(), rtol=0, atol=2e-4)  # h: up to its ulps
    assert (sums[2] - gz_down.float().t() @ exact).abs().max() > 1e-3


def _norm_output(x, weight):
    """A marked RMSNorm output, as the patched norm gives it (``recompute_norm``)."""
    module = types.SimpleNamespace(weight=weight, variance_epsilon=1e-6, _trajflow_compile=False,
                                   _trajflow_recompute_norm=True)
    return lean_ops._norm_forward(module, x)


def _op_runs(runtime, fold_pair: bool, norm: bool, fold_down: bool = False, row_fold_down: bool = False,
             frozen: int | None = None, rank: int = RANK):
    """{fused: (ys, dxs, masters' grads)} over two micro-batches whose LoRA gradients accumulate, the op with and
    without the kernels on the same weights; ``frozen``: the index of a master that takes no gradient."""
    g = torch.Generator().manual_seed(3)
    linears = [_linear(g, INTER, HIDDEN, False), _linear(g, INTER, HIDDEN, False), _linear(g, HIDDEN, INTER, False)]
    masters = [_masters(g, INTER, HIDDEN, rank), _masters(g, INTER, HIDDEN, rank), _masters(g, HIDDEN, INTER, rank)]
    if fold_pair:
        fold_linears(linears[:2], [rank, rank])
    if fold_down:
        fold_linears(linears[2:], [rank])
    if row_fold_down:
        fold_rows(linears[2], rank)
    xs = [torch.randn(2, ROWS // 2, HIDDEN, generator=g) for _ in range(2)]
    upstreams = [torch.randn(2, ROWS // 2, HIDDEN, generator=g) for _ in range(2)]
    norm_weight = 1 + torch.rand(HIDDEN, generator=g)
    runs = {}
    for fused in (False, True):
        ms = [t.detach().clone().requires_grad_() for pair in masters for t in pair]
        if frozen is not None:
            ms[frozen].requires_grad_(False)
        parts = [LoraParts(lin.weight, None, a, b, s, getattr(lin, "_trajflow_fold", None),
                           row_fold=getattr(lin, "_trajflow_row_fold", None))
                 for lin, a, b, s in zip(linears, ms[::2], ms[1::2], (0.5, 2.0, 1.5))]
        ys, dxs = [], []
        for x, upstream in zip(xs, upstreams):
            xi = x.clone().requires_grad_()
            with runtime.casts.scope() if runtime.casts is not None else contextlib.nullcontext():
                inp = _norm_output(xi, norm_weight) if norm else xi
                y = lean_ops.lora_swiglu(inp, *parts, runtime=dataclasses.replace(runtime, fused_swiglu=fused))
                (y * upstream).sum().backward()
            ys.append(y.detach())
            dxs.append(xi.grad)
        runs[fused] = ys, dxs, [m.grad for m in ms]
    return runs


def _assert_same(runs):
    (ys, dxs, grads), (fys, fdxs, fgrads) = runs[False], runs[True]
    for i in range(2):
        _close(fys[i], ys[i], f"y {i}")
        _close(fdxs[i], dxs[i], f"dx {i}")
    names = ["gate dA", "gate dB", "up dA", "up dB", "down dA", "down dB"]
    for name, got, want in zip(names, fgrads, grads):
        if want is None:
            assert got is None, name
        else:
            _close(got, want, name)


@pytest.mark.parametrize("norm", [False, True], ids=["plain-x", "recompute-norm"])
@pytest.mark.parametrize("fold_pair", [False, True], ids=["gate-up-unfolded", "gate-up-folded"])
@pytest.mark.parametrize("runtime", RUNTIMES, ids=RUNTIME_IDS)
def test_the_op_with_the_kernels_equals_the_op_without(runtime, fold_pair, norm, calls):
    _assert_same(_op_runs(runtime, fold_pair, norm))
    assert calls == {"backward": 2}  # the fused run's two micro-batches


@pytest.mark.parametrize("runtime", RUNTIMES[:2], ids=RUNTIME_IDS[:2])
def test_down_row_folded_and_low_rank_first_still_compose(runtime, calls):
    _assert_same(_op_runs(dataclasses.replace(runtime, low_rank_first=True), True, True, row_fold_down=True))
    assert calls["backward"] == 2


def test_down_folded_or_a_small_rank_runs_the_torch_path(calls):
    _assert_same(_op_runs(RUNTIMES[1], True, False, fold_down=True))
    _assert_same(_op_runs(RUNTIMES[1], False, False, rank=8))
    assert calls == {"backward": 0}


@pytest.mark.parametrize("frozen", [1, 4], ids=["gate-B", "down-A"])
def test_a_master_without_gradient_takes_the_torch_backward(frozen, calls):
    _assert_same(_op_runs(RUNTIMES[1], False, False, frozen=frozen))
    assert calls == {"backward": 0}


def test_trainer_steps_with_the_kernels_equal_the_steps_without(tiny_model_path, tmp_path, calls):
    """Two steps, a checkpoint round trip and two more, half the layers checkpointed, norms recomputed: the same
    losses, gradients, Adam updates and logprobs (rank 16: the kernels' smallest)."""
    cfg = dict(fused_lora="on", memory_efficient_ops="on", recompute_norm="on", lora_rank=16, lora_alpha=32,
               learning_rate=1e-3, kl_coef=0.2, gradient_checkpointing=True, checkpoint_layer_fraction=0.5,
               micro_batch_tokens=16)
    runs = {mode: train(tiny_model_path, tmp_path / mode, fused_swiglu_lora=mode, **cfg) for mode in ("off", "on")}
    assert calls["backward"] > 0
    assert_same_training(runs["on"], runs["off"], cfg["learning_rate"], "fused_swiglu_lora")


def test_the_gpu_check_script_runs_on_the_cpu_and_finds_the_two_ways_a_rounding_apart(tmp_path, monkeypatch):
    from benchmarks import swiglu_lora_check

    out = tmp_path / "check.json"
    monkeypatch.setattr(sys, "argv", ["swiglu_lora_check.py", "--smoke", "--out", str(out)])
    swiglu_lora_check.main()
    report = json.loads(out.read_text())
    assert set(report["errors"]) == {"y", "dx", *swiglu_lora_check.NAMES}
    assert max(e["max_rel"] for e in report["errors"].values()) < 1e-5
    assert swiglu_lora_triton.backward.__name__ == "backward"  # its counting wrapper is gone
