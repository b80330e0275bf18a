"""The fused LoRA ops that read one RMSNorm output sum their input gradients in their GEMMs
(``TrainerConfig.chain_input_grads``).

q_proj, k_proj and v_proj read the same norm output n; each backward returns its own dL/dn and autograd sums them:

    dL/dn = dx_q + dx_k + dx_v,   dx_i = g_i W_i + gz_i A_i   (or [g_i | gz_i] [W_i ; A_i], ``fold_lora_a``)

two more passes that each read two [T, hidden] tensors and write one. Chained, the first of these backwards to run
writes its dx as today into a buffer ``S`` held on the readers' shared ``recompute_norm.Recompute``, and each later
one adds its products into S inside its own GEMMs (beta = 1: ``S.addmm_(g, W)``, ``S.addmm_([g | gz], [W ; A])``);
all of them return None for x (autograd: a zero gradient), and the norm's own backward (``lean_ops._RMSNorm``) takes
S and adds to it whatever autograd summed for n from other readers (None where every reader is chained).

Correctness:

1. No reader needs to know it is the last: S is handed over by the norm's backward, which autograd runs only after
   every reader of n that is in the graph has run its backward (its dependencies). A reader whose output does not
   reach the loss never runs its backward and adds nothing, which is its gradient (zero); counting the readers
   (``Recompute.users``, incremented per forward, also by a recomputed forward under activation checkpointing) would
   have lost the others' sum in that case.
2. S belongs to one backward pass: it is stamped with autograd's graph-task id. A sum left by a pass whose norm
   backward did not run (``torch.autograd.grad`` for inputs that n does not lead to) is dropped by the next pass's
   first reader and never handed to a norm; a second backward over a retained graph starts its own S.
3. Where a reader cannot add into S it does not chain and returns its dx to autograd as before, which the norm adds
   to S (mixed readers are exact): a reader whose compute dtype is not n's (S must be n's gradient as it is), an
   op folded on the output side (``fold_lora_b``: q, k, v grouped by ``group_qkv`` are one reader anyway), a
   backward that builds a graph (``create_graph``: in-place adds into S would be differentiated), any reader that is
   not a fused ``_LoraLinear`` (peft's path, the SwiGLU MLP op). FP8 base products (``fp8_base``) and
   ``low_rank_first`` chain through ``lora_input_grad``'s ``into`` (an FP8 g W is added after its GEMM; the
   reordered sum falls back to the base product first, which can add into S).
4. Off (or recompute_norm off: no shared object, no chain) the ops are exactly today's. No-grad passes record
   nothing: no backward, no S.

Simplification: the three dA = gz_i^T n stay three products (``lora_param_grads``); one [gz_q | gz_k | gz_v]^T n
would need n and the three gz kept until the norm's backward, where ``lora_grad_accumulation`` would then add its row
blocks.

The sum's rounding order differs from autograd's ((dx_q + g_k W_k) + gz_k A_k ... instead of dx_q + (g_k W_k +
gz_k A_k)): equal up to rounding, not to the bit.
"""

from __future__ import annotations

import torch


def _task() -> int:
    return torch._C._current_graph_task_id()


class InputGradSum:
    """S, the chained readers' dL/dn (in n's shape) for the backward pass ``task``, or None."""

    __slots__ = ("total", "task")

    def __init__(self) -> None:
        self.total, self.task = None, -1

    def into(self) -> torch.Tensor | None:
        """S for this backward pass (a reader adds its dx into it), or None: the reader's dx starts it."""
        if self.total is not None and self.task != _task():
            self.total = None  # left by another pass, whose norm backward did not run
        return self.total

    def hold(self, grad_x: torch.Tensor, into: torch.Tensor | None) -> None:
        """After a reader's backward: ``grad_x`` (n's shape) becomes S where it started it (``into`` was None)."""
        if into is None:
            self.total, self.task = grad_x, _task()

    def take(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """At the norm's backward: S plus ``grad`` (what autograd summed from readers that did not chain), S dropped."""
        total, self.total = self.into(), None
        if total is None:
            return grad
        return total if grad is None else total.add_(grad)
