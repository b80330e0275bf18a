"""The Triton rotary kernel of ``rope_triton`` under the Triton interpreter: forward and backward against
``fused_rope``'s eager formulas in float32 (and float16, which the interpreter computes right), and the op with it
against transformers' ``apply_rotary_pos_emb`` through autograd.

Not collected by itself: ``test_rope_triton.py`` runs this file in a subprocess with TRITON_INTERPRET=1, which must
be set before triton is imported (other tests of a worker may import it through torch.compile)."""

import json
import os
import sys

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from backends.training.kernels import fused_rope, rope_triton  # noqa: E402

BLOCK = 8  # tokens a program takes here: lengths below end inside a block, at one, or fill a single partial one
LENGTHS = (1, 8, 21)


@pytest.fixture(autouse=True)
def float32_runs(monkeypatch):
    monkeypatch.setattr(rope_triton, "DTYPES", (torch.float32, torch.float16))
    monkeypatch.setattr(rope_triton, "BLOCK_TOKENS", BLOCK)


@pytest.fixture
def calls(monkeypatch):
    """The ``backward`` flags of the kernel's launches."""
    flags, inner = [], rope_triton.rotate

    def counted(*args):
        flags.append(args[4] if len(args) > 4 else False)
        return inner(*args)

    monkeypatch.setattr(rope_triton, "rotate", counted)
    return flags


def _qwen2_angles(length: int, dim: int):
    """cos, sin [1, L, D] as Qwen2's rotary embedding makes them (halves equal), positions restarting in a second
    packed row."""
    positions = torch.cat([torch.arange(length // 2), torch.arange(length - length // 2)]).float()
    freqs = positions[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos(), emb.sin()


def _inputs(length, heads, kv_heads, dim, batch=1, qwen2=False, grouped=False, dtype=torch.float32, seed=0):
    """q, k [B, L, H, D] (with ``grouped``: column slices of one [B, L, (H + 2 Hk) D] projection output, as a grouped
    qkv projection leaves them); cos, sin [B, L, 1, D], Qwen2's or random (halves differ)."""
    g = torch.Generator().manual_seed(seed)
    if grouped:
        qkv = torch.randn(batch, length, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q = qkv[..., :heads * dim].unflatten(-1, (heads, dim))
        k = qkv[..., heads * dim:(heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
    else:
        q = torch.randn(batch, length, heads, dim, generator=g).to(dtype)
        k = torch.randn(batch, length, kv_heads, dim, generator=g).to(dtype)
    if qwen2:
        cos, sin = (t.expand(batch, -1, -1) for t in _qwen2_angles(length, dim))
    else:
        cos, sin = torch.randn(2, batch, length, dim, generator=g).unbind(0)
    return q, k, cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def _formulas(q, k, cos, sin, backward: bool):
    return (fused_rope._rotate_grad_pair if backward else fused_rope._rotate_pair)(q, k, cos, sin)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("shape", [dict(heads=4, kv_heads=2, dim=16), dict(heads=6, kv_heads=1, dim=12, batch=2),
                                   dict(heads=4, kv_heads=2, dim=16, grouped=True, qwen2=True)],
                         ids=["gqa-4-2", "D-12-batch-2", "grouped-qkv-qwen2-angles"])
def test_the_kernel_is_the_eager_formulas_in_float32(shape, length, backward):
    q, k, cos, sin = _inputs(length, **shape)
    assert rope_triton.runs(q, k, cos, sin)
    got, want = rope_triton.rotate(q, k, cos, sin, backward), _formulas(q, k, cos, sin, backward)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cos_of_one_sequence_broadcast_over_a_batch():
    q, k, cos, sin = _inputs(13, 4, 2, 16, batch=3)
    one_cos, one_sin = cos[:1], sin[:1]
    assert rope_triton.runs(q, k, one_cos, one_sin)
    for backward in (False, True):
        for a, b in zip(rope_triton.rotate(q, k, one_cos, one_sin, backward),
                        _formulas(q, k, one_cos, one_sin, backward)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_in_float16_each_result_is_rounded_once():
    """fp16 in and out, float32 cos/sin: the formulas' float32 result rounded once (within an ulp: the interpreter
    and torch may take the products and sum in another order)."""
    q, k, cos, sin = _inputs(21, 4, 2, 16, dtype=torch.float16)
    cos, sin = cos.float(), sin.float()
    assert rope_triton.runs(q, k, cos, sin)
    for backward in (False, True):
        for a, b in zip(rope_triton.rotate(q, k, cos, sin, backward), _formulas(q, k, cos, sin, backward)):
            assert a.dtype == torch.float16
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_the_op_with_the_kernel_equals_stock_through_autograd(unsqueeze_dim, calls):
    """q/k' and dL/dq, dL/dk of ``fused_rope(..., compile=True)`` (the kernel each way) against autograd through
    transformers' Qwen2 ``apply_rotary_pos_emb``, q and k in q_proj's memory layout, cos/sin halves differing."""
    q, k, cos, sin = _inputs(21, 4, 2, 16)
    cos, sin = cos.squeeze(2), sin.squeeze(2)
    view = (lambda x: x.transpose(1, 2)) if unsqueeze_dim == 1 else (lambda x: x)
    g = torch.Generator().manual_seed(1)
    up_q, up_k = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    runs = {}
    for name, fn in (("stock", modeling_qwen2.apply_rotary_pos_emb),
                     ("kernel", lambda *a, **kw: fused_rope.fused_rope(*a, **kw, compile=True))):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        q2, k2 = fn(view(qi), view(ki), cos, sin, unsqueeze_dim=unsqueeze_dim)
        ((view(q2) * up_q).sum() + (view(k2) * up_k).sum()).backward()
        runs[name] = (view(q2), view(k2), qi.grad, ki.grad)
    assert calls == [False, True]
    for name, a, b in zip(("q'", "k'", "dq", "dk"), runs["kernel"], runs["stock"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert runs["kernel"][0].is_contiguous() and runs["kernel"][1].is_contiguous()  # [B, L, H, D]: q_proj's layout


def test_runs_takes_the_shapes_and_strides_the_kernel_assumes():
    q, k, cos, sin = _inputs(5, 4, 2, 16, batch=2)
    assert rope_triton.runs(q, k, cos, sin) and rope_triton.runs(q, k, cos[:1], sin[:1])
    odd = _inputs(5, 4, 2, 15)
    refused = {
        "D odd": odd,
        "q's last dim strided": (q.transpose(2, 3).contiguous().transpose(2, 3), k, cos, sin),
        "k of another dtype": (q, k.half(), cos, sin),
        "bfloat16 outside DTYPES": (q.bfloat16(), k.bfloat16(), cos, sin),
        "float64 cos": (q, k, cos.double(), sin),
        "cos not broadcast over heads": (q, k, cos.expand(-1, -1, 4, -1), sin),
        "cos of another length": (q, k, cos[:, :4], sin[:, :4]),
        "k of another batch": (q, k[:1], cos, sin),
        "[B, L, D] cos": (q, k, cos.squeeze(2), sin.squeeze(2)),
    }
    for name, args in refused.items():
        assert not rope_triton.runs(*args), name


def test_the_gpu_check_script_runs_on_the_cpu(tmp_path, monkeypatch):
    from benchmarks import rope_check

    out = tmp_path / "rope.json"
    monkeypatch.setattr(sys, "argv", ["rope_check.py", "--smoke", "--out", str(out)])
    rope_check.main()
    report = json.loads(out.read_text())
    assert [r["tokens"] for r in report["lengths"]] == list(rope_check.SMOKE_LENGTHS)
    for row in report["lengths"]:
        assert set(row["max_abs_diff"]) == {"forward", "backward"}
        assert max(row["max_abs_diff"].values()) < 1e-6
