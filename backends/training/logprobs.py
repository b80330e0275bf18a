"""Token logprobs and entropies from hidden states, in chunks, never holding all the logits.

For hidden state h_t (the decoder output before the token it predicts), output-head weight W and
temperature T:

    z_t = W h_t / T,   logp_t = z_t[y_t] - logsumexp(z_t),   H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v

``chunked_logprobs`` is a custom autograd function: the forward pass walks the tokens in chunks of
``chunk`` (chunk x vocab logits at a time, in float32 for the softmax) and keeps only h, W, the targets
and one logsumexp per token; the backward pass recomputes each chunk's logits and applies
d logp_t / d z_t = onehot(y_t) - softmax(z_t). Peak extra memory is one chunk's logits, whatever the
sequence length. The entropy is a metric only (no gradient). The caller passes just the positions
that carry loss, so prompt and tool tokens cost no vocabulary projection at all. A separable loss need not recompute
the logits: ``logprob_grad_in_forward.py`` walks the same chunks (``chunk_walk``) and computes the gradient there.

Logits are float32 straight out of the matrix product (``backends.modeling.logits``: no bf16 rounding of the
logits, as in the inference engine). The per-chunk float32 math (``_chunk_stats``, ``_chunk_grad``) runs eagerly, or through torch.compile
(``compile=True``: fused kernels that read each chunk's logits once instead of several float32 passes).
"""

from __future__ import annotations

import torch

from backends.modeling.logits import logits_fp32
from backends.training.kernels.torch_compile import kernel


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """(logp, entropy, lse) of one chunk; logits [n, V] as the matrix product gave them, float32 math."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    probs = torch.exp(z - lse[:, None])
    entropy = lse - (probs * z).sum(-1)
    return logp, entropy, lse


def _chunk_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                inv_temp: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dL/d(logits) of one chunk: (onehot(y) - softmax(z)) * dL/dlogp * inv_temp, in ``out_dtype``."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z * inv_temp
    gl = grad_logp.float()[:, None]
    g = torch.exp(z - lse[:, None]) * -gl
    g = g.scatter_add(1, targets[:, None], gl)
    if inv_temp != 1.0:
        g = g * inv_temp
    return g.to(out_dtype)


def chunk_kernels(compile: bool):
    """(stats, grad) per-chunk functions: eager, or torch.compile'd once per process
    (``backends.training.kernels.torch_compile``)."""
    return kernel(_chunk_stats, compile), kernel(_chunk_grad, compile)


def chunk_walk(hidden, weight, targets, chunk: int, inv_temp: float, compile: bool, each=None):
    """(logp, entropy, lse) [N] float32, ``chunk`` tokens at a time; ``each(s, e, logits, logp, lse)`` (optional) runs
    on every chunk while its logits exist."""
    stats, _ = chunk_kernels(compile)
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        logits = logits_fp32(hidden[s:e], weight)
        logp[s:e], entropy[s:e], lse_all[s:e] = stats(logits, targets[s:e], inv_temp)
        if each is not None:
            each(s, e, logits, logp[s:e], lse_all[s:e])
    return logp, entropy, lse_all


class HeadGrads:
    """dL/dh (in h's dtype) and dL/dW (float32 sums, W's dtype out) of the output head, filled a chunk at a time from
    dL/d(logits) g: dL/dh = g W, dL/dW += g^T h."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool):
        self.hidden, self.weight = hidden, weight
        self.grad_h = torch.empty_like(hidden) if need_h else None
        self.grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None

    def add(self, s: int, e: int, g: torch.Tensor) -> None:
        if self.grad_h is not None:
            self.grad_h[s:e] = g @ self.weight
        if self.grad_w is not None:
            self.grad_w += g.t().float() @ self.hidden[s:e].float()

    def weight_grad(self) -> torch.Tensor | None:
        return None if self.grad_w is None else self.grad_w.to(self.weight.dtype)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, inv_temp: float, compile: bool):
        logp, entropy, lse_all = chunk_walk(hidden, weight, targets, chunk, inv_temp, compile)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk, ctx.inv_temp, ctx.compile = chunk, inv_temp, compile
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        _, grad_fn = chunk_kernels(ctx.compile)
        grads = HeadGrads(hidden, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            grads.add(s, e, grad_fn(logits_fp32(hidden[s:e], weight), targets[s:e], lse_all[s:e], grad_logp[s:e],
                                    ctx.inv_temp, hidden.dtype))
        return grads.grad_h, grads.weight_grad(), None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 2048, temperature: float = 1.0,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) of ``targets`` [N] under logits W h / T; hidden [N, H], weight [V, H]. float32 out.

    ``compile``: run the per-chunk softmax math through torch.compile (fused kernels; same formulas).
    """
    hidden = checked_hidden(hidden, weight, targets)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _ChunkedLogprob.apply(hidden, weight, targets.long(), int(chunk), 1.0 / float(temperature),
                                     bool(compile))


def checked_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``hidden`` [N, H] in the weight's dtype; a ValueError unless targets is [N]."""
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    return hidden if hidden.dtype == weight.dtype else hidden.to(weight.dtype)


def full_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """The unchunked reference: materialises all [N, V] logits (used by tests and the baseline)."""
    logits = logits_fp32(hidden, weight) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, targets[:, None].long()).squeeze(1), entropy.detach()
