"""A separable loss's gradient through the output head, computed in the logprob forward while each chunk's logits exist.

With z_t = W h_t / T and a step loss L = sum_t f_t(logp_t) whose token terms each read their own logprob alone (the
separable losses, ``losses.SEPARABLE_LOSSES``), dL/dlogp_t = f_t'(logp_t) is known as soon as logp_t is, so

    dL/dh_t = sum_v (onehot(y_t) - softmax(z_t))_v * dL/dlogp_t * W_v / T,    dL/dW = sum_t (...)_t^T h_t / T

are computed chunk by chunk in the same walk that computes logp (``logprobs.chunk_walk``). Today's op
(``logprobs.chunked_logprobs``) keeps h and recomputes every chunk's logits in the backward (a second
[chunk, V] x H product and a [chunk, V] float32 write); this one keeps dL/dh instead of h (the same [N, H] in h's
dtype) and its backward only scales it by the upstream gradient of the loss.

Choices:
- dL/dlogp of a chunk comes from the loss itself: ``torch.autograd.grad`` of ``token_loss(logp leaf, chunk)`` (the
  chunk's share of L) on a detached leaf, so no loss has a hand-written second derivative to drift from it. Each
  token's derivative runs through the same elementwise ops as in the whole micro-batch's backward, so it is the
  same number, and so are dL/dh (the same per-chunk kernel and product) and every gradient under it.
- The loss value comes from the caller (``attach``): it evaluates the loss on the detached logp as the unfused path
  does on the attached one (the same value, the same stats) and ``attach`` gives that value this gradient.
- Non-separable losses (GSPO) cannot use it: a row's first token's derivative needs the row's last logp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.training.logprobs import HeadGrads, checked_hidden, chunk_kernels, chunk_walk


class _SavedHeadGrad(torch.autograd.Function):
    """``value`` as it is, whose gradient into (hidden, weight) is the saved (dL/dh, dL/dW) times the upstream one."""

    @staticmethod
    def forward(ctx, value, hidden, weight, grad_h, grad_w):
        ctx.save_for_backward(grad_h, grad_w)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (None, None if grad_h is None else grad_h * grad_out, None if grad_w is None else grad_w * grad_out,
                None, None)


class HeadGradInForward:
    """The detached ``logp`` and ``entropy`` [N] float32 of the trained tokens, and ``attach`` to turn the loss value
    computed from them into the differentiable step loss."""

    def __init__(self, hidden, weight, logp, entropy, grads: HeadGrads):
        self.logp, self.entropy = logp, entropy
        self._inputs, self._grads = (hidden, weight), grads

    def attach(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (the loss of ``logp``, a scalar) whose backward puts dL/dh and dL/dW into hidden and weight."""
        grads, self._grads = self._grads, None  # once: the saved dL/dh lives in the graph only from here
        return _SavedHeadGrad.apply(value, *self._inputs, grads.grad_h, grads.weight_grad())


def logprobs_with_head_grad(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    token_loss: Callable[[torch.Tensor, slice], torch.Tensor], chunk: int = 2048, temperature: float = 1.0,
    compile: bool = False,
) -> HeadGradInForward:
    """logp and entropy of ``targets`` under logits W h / T (``logprobs.chunked_logprobs``' formulas, the same
    values), with dL/dh and dL/dW of the separable loss L computed on the way; ``token_loss(logp, sl)``: the share of
    L of the tokens ``sl`` (a slice of the N), given their logp (with gradient)."""
    hidden, targets = checked_hidden(hidden, weight, targets), targets.long()
    _, grad_fn = chunk_kernels(compile)
    inv_temp = 1.0 / float(temperature)
    grad_on = torch.is_grad_enabled()
    grads = HeadGrads(hidden, weight, grad_on and hidden.requires_grad, grad_on and weight.requires_grad)

    def backprop(s: int, e: int, logits: torch.Tensor, logp: torch.Tensor, lse: torch.Tensor) -> None:
        leaf = logp.detach().requires_grad_()
        with torch.enable_grad():
            (grad_logp,) = torch.autograd.grad(token_loss(leaf, slice(s, e)), leaf)
        grads.add(s, e, grad_fn(logits, targets[s:e], lse, grad_logp, inv_temp, hidden.dtype))

    with torch.no_grad(), torch.autocast(device_type=hidden.device.type, enabled=False):
        logp, entropy, _ = chunk_walk(hidden, weight, targets, int(chunk), inv_temp, bool(compile), backprop)
    return HeadGradInForward(hidden, weight, logp, entropy, grads)
