"""Leaner ops for Llama/Qwen-style decoders: RMSNorm, SwiGLU, and the whole LoRA SwiGLU MLP as one op.

Autograd keeps every intermediate an op needs for its backward pass. For the elementwise blocks of a
decoder layer that is wasteful:

- RMSNorm  y = w * (x * rstd(x)).to(dtype),  rstd = 1/sqrt(mean(x^2) + eps), computed in float32.
  Stock autograd keeps the float32 copy of x, the float32 normalised x and its cast (~10 bytes per
  element in bf16). ``_RMSNorm`` keeps x (2 bytes) and rstd (4 bytes per token) and recomputes:
  dL/dx = rstd * (g_n - n * mean(g_n * n)),  g_n = dL/dy * w,  n = x * rstd;  dL/dw = sum(dL/dy * n).
- SwiGLU   h = silu(g) * u.  Stock autograd keeps g, silu(g) and u; ``_SiluMul`` keeps g and u and
  recomputes silu: dL/du = dL/dh * silu(g),  dL/dg = dL/dh * u * s * (1 + g * (1 - s)),  s = sigmoid(g).
- LoRA SwiGLU MLP  y = down(silu(gate(x)) * up(x)), each projection a LoRA linear (``fused_lora``).
  Stock (even with the fused LoRA linear) keeps g, silu(g), u and h: four intermediate-width tensors
  per token. ``_LoraSwiGLU`` keeps x, g, u and the rank-r z of each projection, and recomputes h in
  backward inside the same kernel that forms dL/dg and dL/du (h is needed for dL/dA of down): half the
  MLP's stored activations, which are most of a layer's.

The elementwise math (``_norm``, ``_norm_grad``, ``_silu_mul``, ``_silu_mul_grads``...) runs through
torch.compile on CUDA (one fused kernel each, float32 inside; ``backends.training.kernels.torch_compile``) and eagerly on the
CPU, where the forward is bit-identical to stock. Compiled, the forward differs from stock by rounding
only (stock rounds silu(g) to bf16 before the product). History: the first version ran these backward
passes eagerly as several float32 kernels and cost 26% of throughput on an H200 for 5.5 GiB less memory.

Applied by ``patch_model`` to modules that look like these blocks (an RMSNorm with ``weight`` and
``variance_epsilon``; an MLP with gate/up/down projections and a SiLU activation); anything else is
left alone. The MLP takes the fused LoRA path only when all three projections are plain fusable LoRA
(``fused_lora.fusable_parts``, read through ``cached_parts``) with no bias, else the SwiGLU op between the
projections' own forwards (so a disabled adapter, as in the KL reference pass, still means the base model).

With gate and up folded as one group (``fold_lora_b``: their weights in [W | .. (sB)_c ..] buffers that read one
xz = [x | z_gate | z_up]), the op keeps xz instead of x and the two z's (the same bytes) and gets gate's and up's
outputs, and in backward dL/dx with both dL/dz's, one product per projection; down folded alone works the same on h.
Down not folded so but row-folded (``fold_lora_a``: its weight the first rows of a [W ; A_c] buffer) gets dL/dh as one
product [dy | dy (sB)_c] [W ; A_c].
A projection not folded whose base weight was quantized (``fp8_base``) takes its x W^T and g W as FP8 GEMMs inside
the trainer's training scope, its LoRA terms unchanged.
With ``LoraRuntime.low_rank_first`` each unfolded bf16 projection takes its rank-r product first and its base GEMM
adding into it (``fused_lora``), forward and dL/dh; of dL/dx only gate's product, which up's then adds into.

With ``LoraRuntime.fused_swiglu`` and down not folded by ``fold_lora_b`` (nor any projection fp8), the backward's
dL/dg, dL/du and the sums behind dA_down, dB_gate and dB_up come from one Triton kernel that never writes h
(``swiglu_lora_triton``, where it can run: CUDA, bf16/fp16, one rank, a power of two >= 16, all six masters taking
gradients); elsewhere, and in the forward, the compiled elementwise kernels above.

With ``recompute_norm`` each RMSNorm marks its output with its x and rstd (``recompute_norm.mark``), and the MLP op
fed by it keeps those (and, folded, its z's) instead of x or xz, recomputing x in backward; the norm's backward adds
the sum of dL/dn that its chained readers left (``chain_input_grads``) to the gradient autograd hands it.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from backends.training.kernels import swiglu_lora_triton
from backends.training.kernels.fused_lora import (
    PLAIN,
    LoraRuntime,
    as_dtype,
    autocast_off,
    cached_parts,
    cast_parts,
    compute_dtype,
    lora_forward,
    lora_input_grad,
    lora_param_grads,
)
from backends.training.kernels.fold_lora_a import folded_a_input_grad, runs_row_folded
from backends.training.kernels.fold_lora_b import fold_input, folded_input_grad, folded_product, runs_folded
from backends.training.kernels.recompute_norm import (NormSource, keep, mark, normalized, restore, restore_folded,
                                                      shared, source_of)
from backends.training.kernels.torch_compile import kernel

# the six LoRA masters' positions among _LoraSwiGLU's inputs (needs_input_grad)
_MASTERS = (8, 9, 11, 12, 14, 15)


def _norm(x, weight, eps: float):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return normalized(x, weight, rstd), rstd


def _norm_grad(grad, x, weight, rstd):
    n = x.float() * rstd
    gn = grad.float() * weight.float()
    return (rstd * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _silu_mul_grads(grad, gate, up):
    g32, s = gate.float(), torch.sigmoid(gate.float())
    grad32 = grad.float()
    grad_up = (grad32 * g32 * s).to(up.dtype)
    grad_gate = (grad32 * up.float() * s * (1 + g32 * (1 - s))).to(gate.dtype)
    return grad_gate, grad_up


def _silu_mul_grads_and_value(grad, gate, up):
    return (*_silu_mul_grads(grad, gate, up), _silu_mul(gate, up))


class _RMSNorm(torch.autograd.Function):
    """(y, rstd): rstd is returned (no gradient) for ``recompute_norm.mark``; it is the tensor the backward keeps."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, compile: bool):
        y, rstd = kernel(_norm, compile)(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        ctx.compile = compile
        return y, rstd

    @staticmethod
    def backward(ctx, grad, _):
        input_grads = getattr(ctx, "input_grads", None)  # set where the output was marked (_norm_forward)
        if input_grads is not None:
            grad = input_grads.take(grad)
        if grad is None:
            return None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[1]:
            n = (x.float() * rstd).to(x.dtype).float()
            grad_w = (grad.float() * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return kernel(_norm_grad, ctx.compile)(grad, x, weight, rstd), grad_w, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, compile: bool):
        ctx.save_for_backward(gate, up)
        ctx.compile = compile
        return kernel(_silu_mul, compile)(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return (*kernel(_silu_mul_grads, ctx.compile)(grad, gate, up), None)


class _LoraSwiGLU(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with LoRA on all three; see the module docstring for what is stored."""

    @staticmethod
    def forward(ctx, x, scalings, dtype, compile, runtime, folds, fp8s, gate_w, gate_a, gate_b, up_w, up_a, up_b,
                down_w, down_a, down_b):
        gate_fold, up_fold, down_fold, down_row_fold = folds
        with autocast_off(x.device.type):
            x2 = as_dtype(x.reshape(-1, x.shape[-1]), dtype)
            gw, _, ga, gsb = cast_parts(gate_w, None, gate_a, gate_b, scalings[0], dtype, runtime.casts)
            uw, _, ua, usb = cast_parts(up_w, None, up_a, up_b, scalings[1], dtype, runtime.casts)
            dw, _, da, dsb = cast_parts(down_w, None, down_a, down_b, scalings[2], dtype, runtime.casts)
            ctx.fold_pair = runs_folded([gate_fold, up_fold], [gate_w, up_w], [gsb, usb])
            ctx.fold_down = runs_folded([down_fold], [down_w], [dsb])
            # the fp8 copies each unfolded projection takes (None: its bf16 product), kept for the backward
            ctx.fp8 = gate_fp8, up_fp8, down_fp8 = [
                None if folded else runtime.fp8_use(f, w, dtype)
                for folded, f, w in zip((ctx.fold_pair, ctx.fold_pair, ctx.fold_down), fp8s, (gate_w, up_w, down_w))]
            # the down row fold where its unfolded backward's dy W is a bf16 product that can take A_c's rows
            ctx.down_row_fold = (runs_row_folded(down_row_fold, down_w, da) if down_row_fold is not None
                                 and not ctx.fold_down and down_fp8 is None else None)
            a_pair = z_pair = None
            source = source_of(x)
            if ctx.fold_pair:  # xz = [x | z_gate | z_up] stands for x and both z's
                a_pair = torch.cat([ga, ua])
                xz, z_pair = fold_input(x2, a_pair)
                gw, uw = gate_fold.extended(gsb), up_fold.extended(usb)
                g, u, z_gate, z_up = folded_product(xz, gw), folded_product(xz, uw), None, None
                # the norm's inputs and z_pair stand for xz where x is a norm's output (recompute_norm)
                x2, z_pair = (xz, None) if source is None else (x2, z_pair)
                del xz
            else:
                g, z_gate = lora_forward(x2, gw, None, ga, gsb, gate_fp8, runtime.low_rank_first)
                u, z_up = lora_forward(x2, uw, None, ua, usb, up_fp8, runtime.low_rank_first)
            # the backward's Triton kernel where it can run: down not folded (its z is h A_down^T, not part of a
            # folded product), no fp8 module, all six masters taking gradients
            ctx.swiglu_grads = (runtime.fused_swiglu and not ctx.fold_down and all(f is None for f in ctx.fp8)
                                and all(ctx.needs_input_grad[i] for i in _MASTERS)
                                and swiglu_lora_triton.runs(g, u, (ga.shape[0], ua.shape[0], da.shape[0])))
            h = kernel(_silu_mul, compile)(g, u)
            if ctx.fold_down:  # [h | z_down] is not kept: backward recomputes h
                hz, z_down = fold_input(h, da)
                dw = down_fold.extended(dsb)
                y = folded_product(hz, dw)
                del hz
            else:
                y, z_down = lora_forward(h, dw, None, da, dsb, down_fp8, runtime.low_rank_first)
        ctx.save_for_backward(*keep(x2, source), z_pair, g, u, z_gate, z_up, z_down, gw, ga, gsb, uw, ua, usb, dw, da,
                              dsb, a_pair)
        ctx.scalings, ctx.compile, ctx.x_shape, ctx.x_dtype = scalings, compile, x.shape, x.dtype
        ctx.norm = shared(source)
        # the fp32 masters themselves (long-lived parameters): their dtypes, and their .grad where the op adds into it
        ctx.masters = ((gate_a, gate_b), (up_a, up_b), (down_a, down_b))
        ctx.into_masters, ctx.low_rank_first = runtime.grads_into_masters, runtime.low_rank_first
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        kept, (z_pair, g, u, z_gate, z_up, z_down, gw, ga, gsb, uw, ua, usb, dw, da, dsb, a_pair) = saved[:3], saved[3:]
        s_gate, s_up, s_down = ctx.scalings
        gate_fp8, up_fp8, down_fp8 = ctx.fp8
        dy = as_dtype(grad.reshape(-1, grad.shape[-1]), g.dtype)
        if ctx.fold_down:
            dh, gz = folded_input_grad([dy], [dw], g.shape[1], da)
        elif ctx.down_row_fold is not None:
            dh, gz = folded_a_input_grad(dy, dsb, ctx.down_row_fold, da)
        else:
            gz = dy @ dsb
            dh = lora_input_grad(dy, gz, dw, da, fp8=down_fp8, low_rank_first=ctx.low_rank_first)
        needs = ctx.needs_input_grad
        n, r_gate = (gw.shape[1] - a_pair.shape[0], ga.shape[0]) if ctx.fold_pair else (None, None)
        if ctx.swiglu_grads:  # dA_down, dB_gate, dB_up from the elementwise kernel (swiglu_lora_triton)
            x2, z_gate, z_up = _gate_up_inputs(ctx, kept, z_pair, z_gate, z_up, g.dtype, n, r_gate)
            grad_g, grad_u, sums = swiglu_lora_triton.backward(dh, g, u, z_gate, z_up, gz)
            del dh
            fused = swiglu_lora_triton.master_grads(sums, (s_gate, s_up), (ctx.masters[0][1], ctx.masters[1][1],
                                                                           ctx.masters[2][0]), ctx.into_masters)
            down_grads = (fused[0], lora_param_grads(dy, gz, None, z_down, s_down, ctx.masters[2], ctx.into_masters,
                                                     (False, True))[1])
        else:
            grad_g, grad_u, h = kernel(_silu_mul_grads_and_value, ctx.compile)(dh, g, u)
            del dh
            down_grads = lora_param_grads(dy, gz, h, z_down, s_down, ctx.masters[2], ctx.into_masters, needs[14:16])
            del h
            x2, z_gate, z_up = _gate_up_inputs(ctx, kept, z_pair, z_gate, z_up, g.dtype, n, r_gate)
            fused = None
        grad_x = None
        if ctx.fold_pair:
            if needs[0]:
                grad_x, gz_pair = folded_input_grad([grad_g, grad_u], [gw, uw], n, a_pair)
                gz_gate, gz_up = gz_pair[:, :r_gate], gz_pair[:, r_gate:]
            else:
                gz_gate, gz_up = grad_g @ gsb, grad_u @ usb
        else:
            gz_gate, gz_up = grad_g @ gsb, grad_u @ usb
            if needs[0]:
                # up adds into gate's dL/dx (``into``): only gate's product can take the low-rank term first
                grad_x = lora_input_grad(grad_g, gz_gate, gw, ga, fp8=gate_fp8, low_rank_first=ctx.low_rank_first)
                grad_x = lora_input_grad(grad_u, gz_up, uw, ua, into=grad_x, fp8=up_fp8)
        if grad_x is not None:
            grad_x = as_dtype(grad_x.view(ctx.x_shape), ctx.x_dtype)
        # with the kernel's sums, each projection's dB is the kernel's and only its dA is a torch product
        gate_needs, up_needs = (needs[8:10], needs[11:13]) if fused is None else ((True, False), (True, False))
        gate_grads = lora_param_grads(grad_g, gz_gate, x2, z_gate, s_gate, ctx.masters[0], ctx.into_masters,
                                      gate_needs)
        up_grads = lora_param_grads(grad_u, gz_up, x2, z_up, s_up, ctx.masters[1], ctx.into_masters, up_needs)
        if fused is not None:
            gate_grads, up_grads = (gate_grads[0], fused[1]), (up_grads[0], fused[2])
        return (grad_x, None, None, None, None, None, None, None, *gate_grads, None, *up_grads, None, *down_grads)


def _gate_up_inputs(ctx, kept, z_pair, z_gate, z_up, dtype, n, r_gate):
    """(x2, z_gate, z_up) for gate's and up's backward: x2 restored (``recompute_norm``), and with gate and up folded
    the z's as slices of z_pair (or of the kept [x | z_gate | z_up]), n its x columns and r_gate gate's rank."""
    if ctx.fold_pair:
        x2, z_pair = restore_folded(kept, z_pair, n, dtype, ctx.norm)
        return x2, z_pair[:, :r_gate], z_pair[:, r_gate:]
    return restore(kept, dtype, ctx.norm), z_gate, z_up


def rms_norm(x, weight, eps, compile: bool = False):
    return _RMSNorm.apply(x, weight, eps, compile)[0]


def silu_mul(gate, up, compile: bool = False):
    return _SiluMul.apply(gate, up, compile)


def lora_swiglu(x, gate, up, down, dtype=None, compile: bool = False, runtime: LoraRuntime = PLAIN):
    """down(silu(gate(x)) * up(x)) for three bias-free ``LoraParts`` in one autograd op."""
    scalings, folds = (gate.scaling, up.scaling, down.scaling), (gate.fold, up.fold, down.fold, down.row_fold)
    fp8s = (gate.fp8, up.fp8, down.fp8)
    return _LoraSwiGLU.apply(x, scalings, dtype or x.dtype, compile, runtime, folds, fp8s, gate.weight, gate.lora_a,
                             gate.lora_b, up.weight, up.lora_a, up.lora_b, down.weight, down.lora_a, down.lora_b)


def _norm_forward(self, hidden_states):
    y, rstd = _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon, self._trajflow_compile)
    if self._trajflow_recompute_norm and y.requires_grad:
        source = NormSource(hidden_states, self.weight, rstd, self._trajflow_compile)
        mark(y, source)
        # y's node is this call's ctx: its backward takes what the readers that chain summed (chain_input_grads)
        y.grad_fn.input_grads = source.shared.input_grads
    return y


def _mlp_forward(self, x):
    if self._trajflow_fuse_lora:
        parts = [cached_parts(getattr(self, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        if all(p is not None and p.bias is None for p in parts):
            return lora_swiglu(x, *parts, dtype=compute_dtype(x), compile=self._trajflow_compile,
                               runtime=self._trajflow_lora_runtime)
    return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x), self._trajflow_compile))


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def patch_model(model, compile: bool = False, fuse_lora: bool = False,
                runtime: LoraRuntime = PLAIN, recompute_norm: bool = False) -> dict[str, int]:
    """Swap the forward of matching RMSNorm and SwiGLU-MLP modules in place; returns how many of each.

    ``compile``: elementwise math through torch.compile. ``fuse_lora``: MLPs whose projections are
    fusable LoRA run as one ``_LoraSwiGLU`` op, with ``runtime``'s cast cache and gradient accumulation.
    ``recompute_norm``: each norm marks its output so the fused ops that read it keep the norm's inputs instead
    (``recompute_norm``).
    """
    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "weight") and hasattr(module, "variance_epsilon"):
            module._trajflow_compile, module._trajflow_recompute_norm = compile, recompute_norm
            module.forward = types.MethodType(_norm_forward, module)
            counts["rms_norm"] += 1
        elif all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) and _is_silu(
            module.act_fn
        ):
            module._trajflow_compile, module._trajflow_fuse_lora = compile, fuse_lora
            module._trajflow_lora_runtime = runtime
            module.forward = types.MethodType(_mlp_forward, module)
            counts["swiglu"] += 1
    return counts
