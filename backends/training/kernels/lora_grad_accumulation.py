"""The LoRA weight gradients added straight into the fp32 masters' ``.grad``, the add in the product's epilogue.

In ``fused_lora``'s notation (products in the compute dtype c, masters A and B in float32, scaling s):

    A.grad += gz^T x,     B.grad += s * (g^T z)

Returned to autograd, each micro-batch costs per LoRA module: the two products in c, their two casts to float32, the
scaling of B's (a third small kernel), and from the second micro-batch on autograd's two adds into ``.grad``: two
GEMMs and five small kernels. ``accumulate`` makes each ONE ``addmm`` into ``.grad`` (beta 1, alpha s):

1. c is the masters' dtype (float32 on the CPU): ``grad.addmm_(m1, m2, alpha=s)``;
2. torch can write a float32 result of c operands (``addmm(..., out_dtype=float32)``, bf16/fp16 on CUDA;
   ``fp32_out_supported`` tries it once per device type and dtype): ``addmm(grad, m1, m2, out_dtype=float32,
   alpha=s, out=grad)``, the product accumulated and kept in float32 (no rounding to c on the way: at least as
   exact as the autograd path, which rounds it to c first);
3. otherwise (bf16 on the CPU, a torch without it): one product in c and one ``add_`` of it, cast and scaled in the
   add (two kernels instead of five).

The ops then return no gradient for A and B, so autograd adds nothing. Where there is no ``.grad`` yet (a step's first
micro-batch) it is allocated uninitialised and written by the same addmm with beta 0 (which ignores the old contents,
NaN included): no zero fill; path 3 fills it with zeros first. Simplification: hooks on those parameters' gradients
(``Tensor.register_hook``, ``register_post_accumulate_grad_hook``) do not fire; nothing in trajflow registers one
(data-parallel reads ``.grad`` after the micro-batches, ``distributed.all_reduce_step``).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def fp32_out_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, m1, m2, out_dtype=float32, beta=0 or 1, alpha=s, out=acc)`` runs for ``dtype``
    operands on this device type, tried once on zeros laid out as the ops' calls are (m1 a transposed view, m2
    contiguous)."""
    try:
        m = torch.zeros(3, 2, dtype=dtype, device=device_type)
        acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        for beta in (0, 1):
            torch.addmm(acc, m.t(), m, out_dtype=torch.float32, beta=beta, alpha=0.5, out=acc)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def accumulate(param: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, alpha: float = 1.0) -> None:
    """``param.grad += alpha * mat1 @ mat2`` in ``param``'s dtype (``param.grad = alpha * mat1 @ mat2`` where it has
    none)."""
    fresh = param.grad is None
    if fresh:
        param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
    grad, beta = param.grad, 0 if fresh else 1
    if mat1.dtype == grad.dtype:
        grad.addmm_(mat1, mat2, beta=beta, alpha=alpha)
    elif fp32_out_supported(mat1.device.type, mat1.dtype) and grad.dtype == torch.float32:
        torch.addmm(grad, mat1, mat2, out_dtype=torch.float32, beta=beta, alpha=alpha, out=grad)
    else:
        if fresh:
            grad.zero_()
        grad.add_(mat1 @ mat2, alpha=alpha)
