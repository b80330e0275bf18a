"""Fused LoRA linear: y = x W^T + b + s * B(A x) as one autograd op (``TrainerConfig.fused_lora``).

peft computes base(x) + (B(A(x)) * s) as four full-width passes over the output (B's product, the
scaling, the add, and in backward the scaling again plus a separate accumulation of the two input
gradients). ``_LoraLinear`` computes the same function with the scaling folded into B and the adds
folded into the matrix products' epilogues (``addmm_``), in the compute dtype c (the autocast dtype,
else x's):

    z = x A_c^T,   y = x W^T + b + z (sB)_c^T
    dL/dz = g (sB)_c,   dL/dx = g W + (dL/dz) A_c,   dL/dA = (dL/dz)^T x,   dL/dB = s g^T z

It stores what peft's path stores (x and z; W, A and sB are parameters or tiny copies). The result
differs from peft's only by rounding (s is applied to B before the cast instead of to the product).
Applied only where it is exact in form: one active plain LoRA adapter (no DoRA or other variant), no
dropout, not merged, adapters enabled, frozen base weight and bias; anything else calls peft.
``lora_forward`` / ``lora_backward`` are the two halves, also used by the fused SwiGLU MLP.

Two per-micro-batch costs around the products are optional (``LoraRuntime``, shared by every patched module):
A_c and (sB)_c made once per optimizer step (``lora_cast_cache``), and dL/dA, dL/dB added straight into the fp32
masters' ``.grad`` in the products' epilogue instead of returned to autograd (``lora_grad_accumulation``). A module
whose base weight was folded (``fold_lora_b``) computes y as one product [x | z] [W | (sB)_c]^T instead; one whose
base weight was quantized (``fp8_base``) takes x W^T and g W as FP8 GEMMs inside the trainer's training scope, the
LoRA terms unchanged (never both: fp8 modules are not folded). One whose base weight was row-folded (``fold_lora_a``)
computes dL/dx as one product [g | gz] [W ; A_c] instead of g W plus a rank-r ``addmm_`` over dx. Where x is a marked
RMSNorm output (``recompute_norm``) the op keeps the norm's x and rstd (and, folded, its z) instead of x or [x | z],
and recomputes x in backward; with ``LoraRuntime.chain_input_grads`` the ops that kept one norm's source add their
dL/dx into one sum in their GEMMs (beta = 1) and return None for x, the norm's backward taking the sum
(``chain_input_grads``).

With ``LoraRuntime.low_rank_first`` (``TrainerConfig.low_rank_first``) an unfolded module whose base product is a
bf16/fp32 GEMM takes the same sums in the other order: t = z (sB)_c^T + b, then y = t + x W^T (``t.addmm_(x, W^T)``),
and in backward t = gz A_c, then dL/dx = t + g W. Today's order ends with a rank-r ``addmm_`` (K = r) that reads and
writes all of the output: a thin product far below memory bandwidth. Reordered the rank-r product only writes t and
the read of t moves into the base GEMM's epilogue (beta = 1, inside a compute-bound product). The bytes on paper are
the same (write t, read t, write y against write y, read y, write y), so whether it pays is the device's beta = 1
kernel against its K = r one: measured, not assumed. An FP8 base product (``fp8_base``: ``torch._scaled_mm`` takes no
C) and an input gradient added into another's (``into``, gate and up of the lean MLP) keep today's order.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from backends.training.kernels.fold_lora_a import RowFoldedWeight, folded_a_input_grad, row_fold_of, runs_row_folded
from backends.training.kernels.fold_lora_b import (
    FoldedWeight,
    fold_input,
    folded_input_grad,
    folded_of,
    folded_product,
    runs_folded,
)
from backends.training.kernels.fp8_base import Fp8Scope, Fp8Use, Fp8Weight, base_input_grad, base_product, fp8_of
from backends.training.kernels.lora_cast_cache import CastCache, lora_casts
from backends.training.kernels.lora_grad_accumulation import accumulate
from backends.training.kernels.recompute_norm import keep, restore, restore_folded, shared, source_of


@dataclass
class LoraParts:
    """One fusable LoRA linear, cast for compute: base weight/bias, A_c, (sB)_c, the scaling s."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor  # the fp32 master parameters (gradients go to these)
    lora_b: torch.Tensor
    scaling: float
    fold: FoldedWeight | None = None  # the base weight's [W | (sB)_c] buffer where it was folded (fold_lora_b)
    fp8: Fp8Weight | None = None  # the base weight's fp8 copies where it was quantized (fp8_base)
    row_fold: RowFoldedWeight | None = None  # the base weight's [W ; A_c] buffer where it was row-folded (fold_lora_a)


@dataclass(frozen=True)
class LoraRuntime:
    """What the fused ops of one trainer share: ``casts``, the cache of A_c and (sB)_c (None: made per call), and
    ``grads_into_masters``: dL/dA and dL/dB added into the masters' ``.grad`` by the op itself (False: returned to
    autograd); ``fp8``: where the base products run in FP8 (``fp8_base``; None: never); ``low_rank_first``: the
    rank-r product first and the base GEMM adding into it (module docstring; False: the base product first);
    ``chain_input_grads``: the ops that read one norm output add their input gradients into one sum in their GEMMs
    (``chain_input_grads``; False: each returns its own to autograd); ``fused_swiglu``: the lean SwiGLU MLP's
    backward elementwise kernel takes its rank-r reductions over [N, I] where it can (``swiglu_lora_triton``; False:
    never)."""

    casts: CastCache | None = None
    grads_into_masters: bool = False
    fp8: Fp8Scope | None = None
    low_rank_first: bool = False
    chain_input_grads: bool = False
    fused_swiglu: bool = False

    def fp8_use(self, fp8: Fp8Weight | None, weight: torch.Tensor, dtype: torch.dtype) -> Fp8Use | None:
        """The fp8 copies one forward takes (``Fp8Scope.use``), or None: the base product in ``dtype``."""
        return None if self.fp8 is None else self.fp8.use(fp8, weight, dtype)


PLAIN = LoraRuntime()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, which is t itself where t has that dtype already; that case skips the call, which would
    still go through torch's dispatcher (host time per op, and the ops here run per layer and micro-batch)."""
    return t if t.dtype == dtype else t.to(dtype)


class autocast_off:
    """``torch.autocast(device_type, enabled=False)`` for the body of a fused op: autocast switched off for the
    device type where it is on, and back on at the exit; nothing at all where it is off. The ops run it per layer and
    micro-batch, and ``torch.autocast``'s own enter and exit (dtype, cache and nesting bookkeeping that a switch-off
    inside an enabled region leaves unchanged) cost several times the switch."""

    __slots__ = ("device_type", "was_on")

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        self.was_on = torch.is_autocast_enabled(self.device_type)
        if self.was_on:
            torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc) -> None:
        if self.was_on:
            torch.set_autocast_enabled(self.device_type, True)


def cast_parts(weight, bias, lora_a, lora_b, scaling: float, dtype, casts: CastCache | None = None):
    """(W_c, b_c, A_c, (sB)_c) in the compute dtype, A_c and (sB)_c through ``casts`` where given."""
    return (as_dtype(weight, dtype), None if bias is None else as_dtype(bias, dtype),
            *lora_casts(casts, lora_a, lora_b, scaling, dtype))


def lora_forward(x2, w, bias, a, sb, fp8: Fp8Use | None = None, low_rank_first: bool = False):
    """(y, z) for 2-D x: z = x A^T, y = x W^T + b + z (sB)^T (x W^T in FP8 where ``fp8`` is given); with
    ``low_rank_first`` and no ``fp8``, y = (z (sB)^T + b) + x W^T, the base GEMM adding into the rank-r product."""
    z = x2 @ a.t()
    if low_rank_first and fp8 is None:
        t = z @ sb.t() if bias is None else torch.addmm(bias, z, sb.t())
        return t.addmm_(x2, w.t()), z
    y = base_product(x2, w, bias, fp8)
    y.addmm_(z, sb.t())
    return y, z


def lora_input_grad(g, gz, w, a, into=None, fp8: Fp8Use | None = None, low_rank_first: bool = False):
    """dL/dx = g W + gz A (gz = dL/dz = g sB), added into ``into`` when given (g W in FP8 where ``fp8`` is given);
    with ``low_rank_first``, no ``into`` and no ``fp8``, dL/dx = gz A + g W, the base GEMM adding into gz A."""
    if low_rank_first and fp8 is None and into is None:
        return (gz @ a).addmm_(g, w)
    return base_input_grad(g, w, fp8, into).addmm_(gz, a)


def lora_param_grads(g, gz, x2, z, scaling: float, masters, into_masters: bool = False, needs=(True, True)):
    """(dL/dA, dL/dB) = (gz^T x, s g^T z) in the master parameters' dtypes; with ``into_masters`` added into
    ``masters``' ``.grad`` instead (``lora_grad_accumulation``) and (None, None) returned. ``needs``: which of the
    two are wanted (a frozen master gets None)."""
    a, b = masters
    if into_masters:
        if needs[0]:
            accumulate(a, gz.t(), x2)
        if needs[1]:
            accumulate(b, g.t(), z, alpha=scaling)
        return None, None
    return ((gz.t() @ x2).to(a.dtype) if needs[0] else None,
            (g.t() @ z).to(b.dtype).mul_(scaling) if needs[1] else None)


def lora_backward(g, x2, w, a, sb, z, scaling: float, masters, need_x: bool = True, into_masters: bool = False,
                  needs=(True, True), fp8: Fp8Use | None = None, row_fold: RowFoldedWeight | None = None,
                  low_rank_first: bool = False, into: torch.Tensor | None = None):
    """(dL/dx, dL/dA, dL/dB) given dL/dy = g (dL/dA, dL/dB: see ``lora_param_grads``); with ``row_fold`` (the
    [W ; A] buffer, ``fold_lora_a``) dL/dx and gz = g sB come from one product [g | gz] [W ; A]; ``low_rank_first``:
    see ``lora_input_grad``; dL/dx added into ``into`` when given (``chain_input_grads``)."""
    if need_x and row_fold is not None:
        grad_x, gz = folded_a_input_grad(g, sb, row_fold, a, into)
    else:
        gz = g @ sb
        grad_x = lora_input_grad(g, gz, w, a, into, fp8, low_rank_first) if need_x else None
    return (grad_x, *lora_param_grads(g, gz, x2, z, scaling, masters, into_masters, needs))


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dtype: torch.dtype, runtime: LoraRuntime,
                fold: FoldedWeight | None, fp8: Fp8Weight | None, row_fold: RowFoldedWeight | None):
        with autocast_off(x.device.type):
            x2 = as_dtype(x.reshape(-1, x.shape[-1]), dtype)
            w, b, a, sb = cast_parts(weight, bias, lora_a, lora_b, scaling, dtype, runtime.casts)
            ctx.folded = runs_folded([fold], [weight], [sb])
            ctx.fp8 = None if ctx.folded else runtime.fp8_use(fp8, weight, dtype)
            # the row fold where the unfolded backward's g W is a bf16 product that can take A_c's rows
            ctx.row_fold = (runs_row_folded(row_fold, weight, a) if row_fold is not None and not ctx.folded
                            and ctx.fp8 is None else None)
            source = source_of(x)  # x is a norm's output: its inputs stand for x2 (recompute_norm)
            if ctx.folded:  # xz = [x | z] stands for x and z: the same bytes
                xz, z = fold_input(x2, a)
                y = folded_product(xz, fold.extended(sb), b)
                w = fold.buffer
                x2, z = (xz, None) if source is None else (x2, z)
                del xz
            else:
                y, z = lora_forward(x2, w, b, a, sb, ctx.fp8, runtime.low_rank_first)
        ctx.save_for_backward(*keep(x2, source), w, a, sb, z)
        ctx.scaling, ctx.x_shape, ctx.x_dtype = scaling, x.shape, x.dtype
        ctx.norm = shared(source)
        # the fp32 masters themselves (long-lived parameters): their dtypes, and their .grad where the op adds into it
        ctx.masters, ctx.into_masters = (lora_a, lora_b), runtime.grads_into_masters
        ctx.low_rank_first = runtime.low_rank_first
        # n's readers sum dL/dn in their GEMMs where this op can add into the sum as it is (chain_input_grads)
        ctx.chain = runtime.chain_input_grads and source is not None and not ctx.folded and x.dtype == dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        kept, (w, a, sb, z) = saved[:3], saved[3:]
        g = as_dtype(grad.reshape(-1, grad.shape[-1]), a.dtype)
        if ctx.folded:
            x2, z = restore_folded(kept, z, w.shape[1] - a.shape[0], a.dtype, ctx.norm)
            grad_x, grad_a, grad_b = _folded_backward(ctx, g, x2, z, w, a, sb)
        else:
            x2 = restore(kept, a.dtype, ctx.norm)
            # a graph-building backward (create_graph) returns its own dx: in-place adds would be differentiated
            chain = ctx.chain and ctx.needs_input_grad[0] and not torch.is_grad_enabled()
            into = ctx.norm.input_grads.into() if chain else None
            grad_x, grad_a, grad_b = lora_backward(g, x2, w, a, sb, z, ctx.scaling, ctx.masters,
                                                   need_x=ctx.needs_input_grad[0], into_masters=ctx.into_masters,
                                                   needs=ctx.needs_input_grad[3:5], fp8=ctx.fp8,
                                                   row_fold=ctx.row_fold, low_rank_first=ctx.low_rank_first,
                                                   into=None if into is None else into.view(-1, into.shape[-1]))
            if chain:  # the norm's backward returns the sum for n (chain_input_grads): autograd gets None for x
                ctx.norm.input_grads.hold(grad_x.view(ctx.x_shape), into)
                grad_x = None
        if grad_x is not None:
            grad_x = as_dtype(grad_x.view(ctx.x_shape), ctx.x_dtype)
        return grad_x, None, None, grad_a, grad_b, None, None, None, None, None, None


def _folded_backward(ctx, g, x2, z, w_ext, a, sb):
    """(dL/dx, dL/dA, dL/dB) of a module folded alone: [dx_base | gz] = g W_ext, dx = dx_base + gz A."""
    if ctx.needs_input_grad[0]:
        grad_x, gz = folded_input_grad([g], [w_ext], x2.shape[1], a)
    else:
        grad_x, gz = None, g @ sb
    return (grad_x, *lora_param_grads(g, gz, x2, z, ctx.scaling, ctx.masters, ctx.into_masters,
                                      ctx.needs_input_grad[3:5]))


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float, dtype: torch.dtype | None = None,
                runtime: LoraRuntime = PLAIN, fold: FoldedWeight | None = None, fp8: Fp8Weight | None = None,
                row_fold: RowFoldedWeight | None = None):
    """base(x) + s * B(A(x)) in one fused autograd op (dtype: compute dtype, default x's; ``fold``: the buffer that
    ``weight`` lives in, as one product where it fits; ``fp8``: the weight's fp8 copies, used inside ``runtime``'s
    fp8 scope; ``row_fold``: the [W ; A_c] buffer that ``weight`` lives in, dL/dx as one product where it fits)."""
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling), dtype or x.dtype, runtime, fold, fp8,
                             row_fold)


def fusable_parts(layer) -> LoraParts | None:
    """The parts of a peft LoRA ``Linear`` whose forward is plain LoRA that the fused op reproduces, else None."""
    if not hasattr(layer, "lora_A") or layer.disable_adapters or layer.merged:
        return None
    active = [n for n in layer.active_adapters if n in layer.lora_A.keys()]
    if len(active) != 1 or active[0] in getattr(layer, "lora_variant", {}):
        return None
    name = active[0]
    base = layer.base_layer
    if not isinstance(base, torch.nn.Linear) or base.weight.requires_grad:
        return None
    if base.bias is not None and base.bias.requires_grad:
        return None
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    a, b = layer.lora_A[name], layer.lora_B[name]
    if a.bias is not None or b.bias is not None:
        return None
    return LoraParts(base.weight, base.bias, a.weight, b.weight, float(layer.scaling[name]), folded_of(base),
                     fp8_of(base), row_fold_of(base))


def _parts_state(layer) -> tuple[tuple, tuple]:
    """(state, held): everything ``fusable_parts`` reads that can change on a live model, as scalars and object ids
    (adapter switches, active and merged adapters, variants, scalings, the base weight and bias, their fold and fp8
    copies, each adapter's A, B and dropout modules), and the objects whose ids it names. Read from the modules' own
    dicts: ``Module.__getattr__`` is most of ``fusable_parts``' host time. The row fold (``fold_lora_a``) is not read:
    ``fold_rows`` gives the module a new weight Parameter with it, whose id the state holds."""
    base, mods = layer._modules["base_layer"], layer._modules
    weight, bias = base._parameters.get("weight"), base._parameters.get("bias")
    held = (weight, bias, base.__dict__.get("_trajflow_fold"), base.__dict__.get("_trajflow_fp8"),
            *(m for key in ("lora_A", "lora_B", "lora_dropout") for m in mods[key]._modules.values()))
    active = layer._active_adapter
    state = (layer._disable_adapters, tuple(layer.merged_adapters), active if isinstance(active, str) else
             tuple(active), tuple(layer.lora_variant), tuple(layer.scaling.items()),
             weight is not None and weight.requires_grad, bias is not None and bias.requires_grad, *map(id, held))
    return state, held


def cached_parts(layer) -> LoraParts | None:
    """``fusable_parts(layer)``, made once and returned again while ``_parts_state`` is what it was when made: a
    forward's per-call host work becomes one state read (the entry holds the objects whose ids it compares, so an id
    is never reused while it lives). A module that is no peft LoRA layer (a projection left out of target_modules)
    goes to ``fusable_parts`` each time."""
    if "lora_A" not in layer._modules or "base_layer" not in layer._modules:
        return fusable_parts(layer)
    state, held = _parts_state(layer)
    entry = layer.__dict__.get("_trajflow_parts")
    if entry is not None and entry[0] == state:
        return entry[1]
    parts = fusable_parts(layer)
    layer.__dict__["_trajflow_parts"] = (state, parts, held)
    return parts


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on for x's device, else x's dtype."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _fused_lora_forward(self, x, *args, **kwargs):
    parts = None if args or kwargs else cached_parts(self)
    if parts is None:
        return self._trajflow_peft_forward(x, *args, **kwargs)
    return _LoraLinear.apply(x, parts.weight, parts.bias, parts.lora_a, parts.lora_b, parts.scaling,
                             compute_dtype(x), self._trajflow_lora_runtime, parts.fold, parts.fp8, parts.row_fold)


def patch_lora(model, runtime: LoraRuntime = PLAIN) -> int:
    """Route every peft LoRA ``Linear`` through ``_LoraLinear`` when fusable (else peft); returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and not hasattr(module, "_trajflow_peft_forward"):
            module._trajflow_lora_runtime = runtime
            module._trajflow_peft_forward = module.forward
            module.forward = types.MethodType(_fused_lora_forward, module)
            count += 1
    return count
