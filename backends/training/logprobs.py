"""Token logprobs and entropies from hidden states, in chunks, never holding all the logits.

For hidden state h_t (the decoder output before the token it predicts), output-head weight W and
temperature T:

    z_t = W h_t / T,   logp_t = z_t[y_t] - logsumexp(z_t),   H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v

``chunked_logprobs`` is a custom autograd function: the forward pass walks the tokens in chunks of
``chunk`` (chunk x vocab logits at a time, in float32 for the softmax) and keeps only h, W, the targets
and one logsumexp per token; the backward pass recomputes each chunk's logits and applies
d logp_t / d z_t = onehot(y_t) - softmax(z_t). Peak extra memory is one chunk's logits, whatever the
sequence length. The entropy is a metric only (no gradient). The caller passes just the positions
that carry loss, so prompt and tool tokens cost no vocabulary projection at all.

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


def _kernels(compile: bool):
    """(stats, grad) per-chunk functions: eager, or torch.compile'd once per process (``backends.training.kernels.torch_compile``)."""
    return kernel(_chunk_stats, compile), kernel(_chunk_grad, compile)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, inv_temp: float, compile: bool):
        stats, _ = _kernels(compile)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp[s:e], entropy[s:e], lse_all[s:e] = stats(logits_fp32(hidden[s:e], weight), targets[s:e], inv_temp)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk, ctx.inv_temp, ctx.compile = chunk, inv_temp, compile
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        _, grad_fn = _kernels(ctx.compile)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            g = grad_fn(logits_fp32(hidden[s:e], weight), targets[s:e], lse_all[s:e], grad_logp[s:e], ctx.inv_temp,
                        hidden.dtype)
            if need_h:
                grad_h[s:e] = g @ weight
            if need_w:
                grad_w += g.t().float() @ hidden[s:e].float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 2048, temperature: float = 1.0,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) of ``targets`` [N] under logits W h / T; hidden [N, H], weight [V, H]. float32 out.

    ``compile``: run the per-chunk softmax math through torch.compile (fused kernels; same formulas).
    """
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _ChunkedLogprob.apply(hidden, weight, targets.long(), int(chunk), 1.0 / float(temperature),
                                     bool(compile))


def full_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """The unchunked reference: materialises all [N, V] logits (used by tests and the baseline)."""
    logits = logits_fp32(hidden, weight) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, targets[:, None].long()).squeeze(1), entropy.detach()
