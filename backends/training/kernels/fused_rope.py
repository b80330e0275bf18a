"""Rotary position embedding of q and k as ONE autograd op per attention layer.

    q' = q * cos + R(q) * sin,   k' = k * cos + R(k) * sin,   R(x) = cat(-x2, x1)  (x1, x2: halves of the head dim)
    dL/dq = g_q * cos - R(g_q * sin)   (R^T = -R),   dL/dk likewise

transformers' ``apply_rotary_pos_emb`` runs this as 5 elementwise ops per tensor forward (mul, neg, cat, mul, add) and
8 backward (two of them ``slice_backward``: a zero fill and a copy each; and a clone of the gradient, which reaches
the projection in another layout than q_proj wrote), each a full pass over q or k and a launch from the host: one
Qwen2 attention layer ran 50 computing aten ops forward + backward on the CPU, 24 with this op counted as one kernel
(tests/unit/backends/training/test_fused_rope.py). ``_FusedRope`` computes each of q' and k' in float32 from the
inputs and rounds once, and keeps only cos and sin (shared by q and k) for backward. q and k differ in heads (12 and 2
at 1.5B), so they go through ONE call each way (one host call).

What runs where:
- CUDA with ``compile`` (the trainer's default there) where ``rope_triton.runs`` holds (bf16/fp16, D even, a
  contiguous last dim: the layouts q_proj and k_proj leave): ``rope_triton``'s Triton kernel, one launch for q and k
  each way. The formulas below compiled took 0.23 ms per backward call on an H200 at the 1.5B shape, ~4x what
  reading and writing q and k once takes. The tests run the kernel on the CPU under Triton's interpreter.
- CUDA otherwise (another dtype, a strided last dim, triton missing): the formulas below compiled by
  ``backends.training.kernels.torch_compile`` (a kernel per tensor at most). Both ways compute in float32 and round
  once: the same function up to the order (and fusing) of float32 operations.
- The CPU: eager, where in float32 it is bit-identical to stock (the same operations in the same order).

Layout: with the stock ``unsqueeze_dim=1`` q arrives as ``[B, H, L, D]``, a transposed view of q_proj's ``[B, L, H, D]``
output. The op computes on the ``[B, L, H, D]`` view and returns its transpose, so q' and k' keep q_proj's layout,
the one the packed attention (``packed_attention.py``) reads without a copy.

Where it plugs in: the attention forward of Llama, Qwen2, Qwen3 and Mistral looks ``apply_rotary_pos_emb`` up in its
modeling module's globals. ``patch_model`` gives each matching attention module a copy of its class's forward
(through any ``functools.wraps`` decorators, such as ``deprecate_kwarg``) whose globals name ``fused_rope`` there
instead: the rest of the forward (projections, the attention interface, o_proj) is transformers' own code, and
nothing changes for other modules of the process (the inference engine's model, say). Replacing the module-level
function would reach every model of that type in the process; a forward override that mirrors transformers' lines
would drift from them (Qwen2's sliding window is one such line).

Loud failure: before patching a family's attention, ``check_stock_rope`` calls its ``apply_rotary_pos_emb`` with our
signature and compares it with ``fused_rope`` on a small input; a changed signature or formula raises instead of
training on another rotation. Other families (partial rotary dims, as Phi-3's; interleaved halves) are left alone.

Simplifications:
1. cos and sin get no gradient in the op (they come from the position ids); where they require one, or
   ``unsqueeze_dim`` is neither 1 nor 2, the same formula runs through autograd.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch

from backends.training.kernels import rope_triton
from backends.training.kernels.torch_compile import kernel

# attention classes whose modeling module's apply_rotary_pos_emb is the stock rotate-half formula
FAMILY = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")
STOCK_NAME = "apply_rotary_pos_emb"
STOCK_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")


def _rotate(x, cos, sin):
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _rotate_grad(grad, cos, sin):
    gs = grad.float() * sin
    g1, g2 = gs.chunk(2, dim=-1)
    return (grad.float() * cos - torch.cat((-g2, g1), dim=-1)).to(grad.dtype)


def _rotate_pair(q, k, cos, sin):
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate_grad_pair(grad_q, grad_k, cos, sin):
    return _rotate_grad(grad_q, cos, sin), _rotate_grad(grad_k, cos, sin)


def _seq_major(x, unsqueeze_dim: int):
    """[B, H, L, D] -> the [B, L, H, D] view q_proj wrote (unsqueeze_dim 1); already [B, L, H, D] otherwise."""
    return x.transpose(1, 2) if unsqueeze_dim == 1 else x


def _rotated(q, k, cos, sin, compile: bool, backward: bool):
    """The op's math on the [B, L, H, D] views, forward or backward: the Triton kernel where it runs and ``compile``
    asks for compiled kernels, else the formulas above, compiled or eager (module docstring)."""
    if compile and rope_triton.runs(q, k, cos, sin):
        return rope_triton.rotate(q, k, cos, sin, backward)
    return kernel(_rotate_grad_pair if backward else _rotate_pair, compile)(q, k, cos, sin)


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim: int, compile: bool):
        # cos, sin: [B, L, D] -> [B, L, 1, D], broadcast over the heads of the [B, L, H, D] views
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q_out, k_out = _rotated(_seq_major(q, unsqueeze_dim), _seq_major(k, unsqueeze_dim), cos, sin, compile, False)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.compile = unsqueeze_dim, compile
        return _seq_major(q_out, unsqueeze_dim), _seq_major(k_out, unsqueeze_dim)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dim = ctx.unsqueeze_dim
        dq, dk = _rotated(_seq_major(grad_q, dim), _seq_major(grad_k, dim), cos, sin, ctx.compile, True)
        return _seq_major(dq, dim), _seq_major(dk, dim), None, None, None, None


def fused_rope(q, k, cos, sin, unsqueeze_dim=1, *, compile: bool = False):
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` as one autograd op; see the module docstring."""
    if unsqueeze_dim not in (1, 2) or cos.requires_grad or sin.requires_grad:  # the formula through autograd
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return _FusedRope.apply(q, k, cos, sin, unsqueeze_dim, compile)


def check_stock_rope(fn) -> None:
    """Raise RuntimeError unless ``fn`` takes ``(q, k, cos, sin, unsqueeze_dim=1)`` and computes what ``fused_rope``
    does (float32, a small GQA input, both unsqueeze dims): the guard against a transformers whose rotary changed."""
    params = tuple(inspect.signature(fn).parameters.values())
    names = tuple(p.name for p in params)
    if names != STOCK_PARAMETERS or params[-1].default != 1:
        raise RuntimeError(f"{fn.__module__}.{fn.__qualname__}{inspect.signature(fn)}: expected "
                           f"({', '.join(STOCK_PARAMETERS)}=1); fused_rope would change its meaning: set "
                           "trainer.fused_rope to 'off'")
    g = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(2, 2, 3, 8, generator=g).unbind(0)
    for dim, shape_q, shape_k in ((1, (2, 4, 3, 8), (2, 2, 3, 8)), (2, (2, 3, 4, 8), (2, 3, 2, 8))):
        q, k = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g)
        want, got = fn(q, k, cos, sin, unsqueeze_dim=dim), fused_rope(q, k, cos, sin, unsqueeze_dim=dim)
        if not all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got, want)):
            raise RuntimeError(f"{fn.__module__}.{fn.__qualname__} no longer computes q*cos + rotate_half(q)*sin: "
                               "set trainer.fused_rope to 'off'")


def _with_global(fn, name: str, value):
    """A copy of ``fn`` whose globals map ``name`` to ``value``; through ``functools.wraps`` wrappers, each copied
    with its closure cell of the wrapped function pointing at the copy below it."""
    inner = getattr(fn, "__wrapped__", None)
    cells = fn.__closure__
    if inner is not None and cells and any(c.cell_contents is inner for c in cells):
        inner = _with_global(inner, name, value)
        cells = tuple(types.CellType(inner) if c.cell_contents is fn.__wrapped__ else c for c in cells)
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    else:
        inner = None
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, name: value}, fn.__name__, fn.__defaults__, cells)
    functools.update_wrapper(copy, fn)
    copy.__kwdefaults__ = fn.__kwdefaults__
    if inner is None:
        del copy.__wrapped__
    else:
        copy.__wrapped__ = inner
    return copy


@functools.cache
def _fused_forward(forward, compile: bool):
    """The class's ``forward`` with ``apply_rotary_pos_emb`` bound to ``fused_rope``, made once per class and mode;
    the stock function is checked first."""
    stock = inspect.unwrap(forward).__globals__.get(STOCK_NAME)
    if stock is None or STOCK_NAME not in inspect.unwrap(forward).__code__.co_names:
        raise RuntimeError(f"{forward.__qualname__} no longer calls a module-level {STOCK_NAME}: set "
                           "trainer.fused_rope to 'off'")
    check_stock_rope(inspect.unwrap(stock))
    return _with_global(forward, STOCK_NAME, functools.partial(fused_rope, compile=compile))


def enabled(mode: str, memory_efficient_ops: bool) -> bool:
    """``TrainerConfig.fused_rope`` resolved: 'on', or 'auto' wherever memory_efficient_ops is on (on CUDA by
    default), since both trade stock autograd's elementwise kernels for ops of ours."""
    return mode == "on" or (mode == "auto" and memory_efficient_ops)


def patch_model(model, compile: bool = False) -> int:
    """Make each attention module of a ``FAMILY`` class rotate q and k with ``fused_rope``; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in FAMILY:
            module.forward = types.MethodType(_fused_forward(type(module).forward, compile), module)
            count += 1
    return count
