"""q, k and v of one attention layer as ONE LoRA product (``TrainerConfig.group_qkv``).

An attention forward calls q_proj(x), k_proj(x) and v_proj(x) on the same x. As three fused LoRA ops (``fused_lora``)
that is, per layer, 9 forward products (3 base GEMMs, 3 x A^T, 3 ``addmm_`` of z (sB)^T over y) and 15 backward ones,
k and v narrow (N = 256 at the 1.5B shape). Grouped, with each module's (s_i B_i)_c in its own r_i of R = r_q + r_k +
r_v columns (``fold_lora_b``'s extended weight, stacked):

    forward:   z = x A_cat^T  ([T, R], A_cat = [A_q; A_k; A_v]_c),   xz = [x | z],
               [q | k | v] = xz W_qkv^T + [b_q | b_k | b_v]   (ONE GEMM),
               W_qkv = [[W_q | (s_q B_q)_c 0 0], [W_k | 0 (s_k B_k)_c 0], [W_v | 0 0 (s_v B_v)_c]]
    backward:  g = [g_q | g_k | g_v]  (one copy),   [dx_base | dz] = g W_qkv  (ONE GEMM),   dx = dx_base + dz A_cat,
               dA_i = dz_i^T x,   dB_i = s_i g_i^T z_i

q, k and v are column blocks of one [T, out_q + out_k + out_v] output (views, no copy); the saved activation is xz,
the bytes of x and the three z's (z alone where x is a marked RMSNorm output: ``recompute_norm``). Counted on the
CPU (tests/unit/backends/training/test_group_qkv.py), with the casts
cached and the LoRA grads added into the masters (the CUDA defaults): q, k and v take 4 computing aten ops forward
instead of 9 and 9 backward instead of 17 (one cat of g, g W_qkv, dz A_cat, three dA and three dB, against three
modules' g (sB), g W, gz A, dA, dB and autograd's two adds of their dx); a Qwen2 attention layer with fused_rope, 41
ops forward + backward -> 28. In step time on the H200 it lost: 46,274 tokens/s steady against 46,554 without it
in one call (24k-token micro-batches; benchmarks/results/training-h200.md), so it stays opt-in.

Choices:

1. One buffer: ``group_model`` moves the three frozen weights ONCE into a [out_q + out_k + out_v, in + R] buffer
   (``fold_lora_b.stacked_buffer``) whose row blocks' first ``in`` columns ARE each module's weight (``fold_linears``
   with ``into``: each module's ``weight`` a Parameter over its view, its ``_trajflow_fold`` the row block, so
   ``fold_lora_b`` never folds it again and ``fp8_base`` never quantizes it), and the three biases into one
   [out_q + out_k + out_v] vector the same way: nothing holds a second copy, no bias is concatenated per call. The
   sB columns are written by ``FoldedWeight.extended`` from the casts the unfolded op would multiply by
   (``lora_cast_cache``): rewritten whenever they are new tensors, never stale.
2. How three calls become one op: q_proj's forward runs the grouped op (one autograd Function, three outputs) and
   hands k's and v's outputs over (``QkvGroup``); k_proj and v_proj return theirs only when called with the very
   same x object, unchanged since (its version counter), in the same grad and compute-dtype mode; else they compute
   alone (the per-module op: correct, not grouped). The hand-over is dropped on its use, on any call that does not
   match it, and on the next q_proj call: nothing is returned stale. Patched only in attention classes whose forward
   calls q_proj, k_proj, v_proj in that order on one hidden_states (``ATTENTION``: Llama, Qwen2, Qwen3, Mistral in
   transformers 5.17 and 5.24); another order would compute k and v twice.
3. Where grouping cannot apply, each module runs its per-module op (the same function): an adapter disabled or
   merged or otherwise not fusable (peft's path), a compute dtype other than the buffer's, a weight or bias that no
   longer lives in the buffer (``Module.to`` gives it a tensor of its own). Ranks may differ (R is their sum).
   Set-up skips a layer whose three modules are not all fusable, differ in input size, dtype or device, or have a
   bias on some and not the others. Off with ``fp8_base`` (an fp8 base product cannot share the bf16 GEMM).

Simplifications:

1. dA is three GEMMs (dz_i^T x, one per module), not one dz^T x split: each goes through ``fused_lora``'s
   ``lora_param_grads``, so ``accumulate_lora_grads`` adds each straight into its master's ``.grad`` (one ``addmm``
   per module either way; one [R, in] product would need three adds after it).
2. An output whose gradient is None (not used by the loss) gets zeros in g, never a narrower product.
3. q, k and v are views with the row stride out_q + out_k + out_v, not their own width. The varlen attention takes
   them as they are (last dimension contiguous); the per-row SDPA path with buckets ('cudnn', 'auto''s long rows)
   makes each unpadded row contiguous (``packed_attention._split_rows``): a copy of v there (and of q and k where the
   rotary keeps their layout) that q_proj's own layout never needed; padded rows are copied either way.
"""

from __future__ import annotations

import types

import torch

from backends.training.kernels.fold_lora_b import (
    FoldedWeight,
    fold_input,
    fold_linears,
    folded_input_grad,
    folded_product,
    move_into,
    runs_folded,
    stacked_buffer,
)
from backends.training.kernels.fused_lora import (
    LoraParts,
    LoraRuntime,
    as_dtype,
    autocast_off,
    cached_parts,
    compute_dtype,
    lora_param_grads,
)
from backends.training.kernels.lora_cast_cache import lora_casts
from backends.training.kernels.recompute_norm import keep, restore_folded, shared, source_of

# attention classes whose forward calls q_proj, k_proj and v_proj, in that order, on one hidden_states
ATTENTION = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class QkvGroup:
    """One attention layer's q, k and v peft LoRA linears (``modules``) with their weights in ``weight`` ([out_q +
    out_k + out_v, in + R]: the row blocks ``folds``) and biases in ``bias``; ``_pending`` is the hand-over of k's
    and v's outputs: (x, its stamp, {module id: output}) or None."""

    def __init__(self, modules: list, parts: list[LoraParts]) -> None:
        self.modules = modules
        bases = [m.base_layer for m in modules]
        ranks = [p.lora_a.shape[0] for p in parts]
        self.outs = [p.weight.shape[0] for p in parts]
        self.weight = stacked_buffer(bases, ranks)
        self.folds: list[FoldedWeight] = fold_linears(bases, ranks, into=self.weight)
        self.bias = None
        if parts[0].bias is not None:
            self.bias = torch.zeros(sum(self.outs), dtype=parts[0].bias.dtype, device=parts[0].bias.device)
            for base, view in zip(bases, self.bias.split(self.outs)):
                move_into(base, "bias", view)
        self._pending: tuple | None = None

    def output(self, module, x: torch.Tensor) -> torch.Tensor | None:
        """``module``'s output for ``x`` from the grouped op (q_proj runs it; k_proj and v_proj take the hand-over),
        or None: the module computes alone."""
        if module is self.modules[0]:
            self._pending = None
            outputs = self._grouped(x)
            if outputs is None:
                return None
            self._pending = (x, _stamp(x), {id(m): y for m, y in zip(self.modules[1:], outputs[1:])})
            return outputs[0]
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not x or pending[1] != _stamp(x) or id(module) not in pending[2]:
            return None
        y = pending[2].pop(id(module))
        if pending[2]:
            self._pending = pending
        return y

    def _grouped(self, x: torch.Tensor):
        """(q, k, v) from one ``_QkvLora``, or None where a module cannot run grouped."""
        parts = [cached_parts(m) for m in self.modules]
        if any(p is None for p in parts) or not self._biases_in_place(parts):
            return None
        dtype, runtime = compute_dtype(x), self.modules[0]._trajflow_lora_runtime
        with torch.no_grad():  # the compute copies carry no autograd history (the masters get the gradients)
            casts = [lora_casts(runtime.casts, p.lora_a, p.lora_b, p.scaling, dtype) for p in parts]
        if not runs_folded(self.folds, [p.weight for p in parts], [sb for _, sb in casts]):
            return None
        masters = [t for p in parts for t in (p.lora_a, p.lora_b)]
        return _QkvLora.apply(x, self, dtype, runtime, casts, tuple(p.scaling for p in parts), *masters)

    def _biases_in_place(self, parts: list[LoraParts]) -> bool:
        if self.bias is None:
            return all(p.bias is None for p in parts)
        return all(p.bias is not None and p.bias.data_ptr() == view.data_ptr() and p.bias.dtype == view.dtype
                   for p, view in zip(parts, self.bias.split(self.outs)))


def _stamp(x: torch.Tensor) -> tuple:
    """What must not change between q_proj's call and k's or v's: x's values (version), grad mode, compute dtype."""
    return x._version, torch.is_grad_enabled(), compute_dtype(x)


class _QkvLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: QkvGroup, dtype: torch.dtype, runtime: LoraRuntime, casts, scalings, *masters):
        with autocast_off(x.device.type):
            x2 = as_dtype(x.reshape(-1, x.shape[-1]), dtype)
            a_cat = torch.cat([a for a, _ in casts])
            xz, z = fold_input(x2, a_cat)
            for fold, (_, sb) in zip(group.folds, casts):
                fold.extended(sb)
            y = folded_product(xz, group.weight, None if group.bias is None else as_dtype(group.bias, dtype))
            source = source_of(x)  # x is a norm's output: its inputs and z stand for xz (recompute_norm)
            xz, z = (xz, None) if source is None else (x2, z)
        ctx.save_for_backward(*keep(xz, source), z, group.weight, a_cat)
        ctx.norm = shared(source)
        ctx.outs, ctx.ranks, ctx.scalings = group.outs, [a.shape[0] for a, _ in casts], scalings
        ctx.masters, ctx.into_masters = masters, runtime.grads_into_masters
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return tuple(y_i.view(*x.shape[:-1], y_i.shape[-1]) for y_i in y.split(group.outs, dim=1))

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        kept, (z, w, a_cat) = saved[:3], saved[3:]
        n = w.shape[1] - a_cat.shape[0]
        x2, z = restore_folded(kept, z, n, a_cat.dtype, ctx.norm)
        t = x2.shape[0]
        g = torch.cat([x2.new_zeros(t, o) if g_i is None else as_dtype(g_i.reshape(t, o), x2.dtype)
                       for g_i, o in zip(grads, ctx.outs)], dim=1)
        if ctx.needs_input_grad[0]:
            grad_x, dz = folded_input_grad([g], [w], n, a_cat)
            grad_x = as_dtype(grad_x.view(ctx.x_shape), ctx.x_dtype)
        else:
            grad_x, dz = None, g @ w[:, n:]
        param_grads, o, r = [], 0, 0
        for i, (out, rank, scaling) in enumerate(zip(ctx.outs, ctx.ranks, ctx.scalings)):
            param_grads += lora_param_grads(g[:, o:o + out], dz[:, r:r + rank], x2, z[:, r:r + rank],
                                            scaling, ctx.masters[2 * i:2 * i + 2], ctx.into_masters,
                                            ctx.needs_input_grad[6 + 2 * i:8 + 2 * i])
            o, r = o + out, r + rank
        return grad_x, None, None, None, None, None, *param_grads


def _grouped_forward(self, x, *args, **kwargs):
    y = None if args or kwargs else self._trajflow_qkv.output(self, x)
    return self._trajflow_ungrouped_forward(x, *args, **kwargs) if y is None else y


def group_model(model, parts_of) -> int:
    """Group q_proj, k_proj and v_proj of every ``ATTENTION`` module of ``model`` whose three are patched fused LoRA
    linears (``fused_lora.patch_lora``), fusable (``parts_of``: ``fused_lora.fusable_parts``), not folded nor
    quantized, alike in input size, dtype and device, and all or none with a bias; returns how many layers."""
    count = 0
    for attention in model.modules():
        if type(attention).__name__ not in ATTENTION:
            continue
        modules = [getattr(attention, name, None) for name in PROJECTIONS]
        if not all(hasattr(m, "_trajflow_peft_forward") and not hasattr(m, "_trajflow_qkv") for m in modules):
            continue
        parts = [parts_of(m) for m in modules]
        if any(p is None or p.fold is not None or p.fp8 is not None for p in parts):
            continue
        if len({(p.weight.shape[1], p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) != 1:
            continue
        group = QkvGroup(modules, parts)
        for m in modules:
            m._trajflow_qkv = group
            m._trajflow_ungrouped_forward = m.forward
            m.forward = types.MethodType(_grouped_forward, m)
        count += 1
    return count


def grouped_layers(model) -> list[QkvGroup]:
    """The ``QkvGroup`` of every grouped attention layer of ``model``, once each."""
    return list({id(g): g for m in model.modules() if (g := getattr(m, "_trajflow_qkv", None)) is not None}.values())
