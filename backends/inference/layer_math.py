"""The maths of one decoder layer as functions of plain tensors: nothing in them names a layer (the weights are
arguments), so torch.compile traces each once and the same compiled code runs all layers (`layer_compile`).

- ``rms_norm``, ``rope``: Hugging Face's RMSNorm and rotary embedding (see each).
- ``project(x, p)``: a projection group (the projections that read one input: q/k/v, o, gate/up, down) as one
  matmul or one per member, plus its LoRA term (`lora_slots`).
- ``before_attention`` / ``after_attention``: a layer around its attention, for prefill and decode alike::

      before:  x <- x + r   (r: the previous layer's MLP output; none at layer 0)
               h = rms_norm_1(x);  q, k, v = h W_qkv (+ LoRA);  q, k <- rope(q), rope(k)      -> x, q, (k, v)
      after:   x <- x + attn W_o (+ LoRA);  h = rms_norm_2(x);  g, u = h W_gu (+ LoRA)
               r = (act(g) * u) W_down (+ LoRA)                                               -> x, r

  The residual add of ``r`` is the next layer's first op (and the final norm's, after the last layer), so that a
  compiled ``before_attention`` fuses it with that layer's norm.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from backends.inference.lora_slots import LoraTerms, add_lora_, lora_delta


class Proj(NamedTuple):
    """A projection group's operands. One matmul: `weight` [out_1+…+out_M (+ the LoRA A rows when A is fused),
    in] and `bias` (None if none), `parts` None. One matmul per member: `parts` ((w, b), …), `weight` None.
    `lora`: the group's LoRA term over the batch's rows, or None when no row uses an adapter."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    parts: tuple | None
    out_sizes: tuple[int, ...]
    lora: LoraTerms | None


def rms_norm(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Hugging Face's RMSNorm: weight * (x / sqrt(mean(x^2) + eps)) computed in float32, cast back before the weight.
    On CUDA, torch's fused kernel (one launch instead of six; the weight is applied before the final rounding)."""
    weight, eps = weight_eps
    if x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(D/2, -1) * signed_sin(sin)``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)`` written as a roll
    times a pre-signed sin: three kernels (mul, roll, addcmul) where the literal form takes five."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def project(x: torch.Tensor, p: Proj) -> torch.Tensor | list[torch.Tensor]:
    """x [N, in] -> [N, out_1+…+out_M] (one matmul) or the members' outputs [N, out_m] (one matmul each), with the
    LoRA term added: in place by one GEMM on a one-matmul group, as a delta per member otherwise."""
    if p.parts is not None:
        outs = [F.linear(x, w, b) for w, b in p.parts]
        if p.lora is None:
            return outs
        return [o + d for o, d in zip(outs, lora_delta(x, p.lora).split(p.out_sizes, dim=-1))]
    y = F.linear(x, p.weight, p.bias)
    if p.lora is None:
        return y
    if p.lora.A is None:  # A is fused: its columns came out of the same GEMM, after the base outputs
        out = sum(p.out_sizes)
        start = out + p.lora.start
        y, h = y[:, :out], y[:, start : start + p.lora.B.shape[0]]
    else:
        h = x @ p.lora.A
    return add_lora_(y, h, p.lora)


def members(y: torch.Tensor | list[torch.Tensor], p: Proj) -> list[torch.Tensor]:
    """The members' outputs of `project`'s result."""
    return y if isinstance(y, list) else list(y.split(p.out_sizes, dim=-1))


def qkv_heads(y, p: Proj, shape: tuple[int, ...], heads: int, kv_heads: int, qk_norms, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (normed if the model norms them, then rotated) and v as [*shape, heads, head_dim] from `project`'s
    result `y` for the q/k/v group; cos/sin broadcast against that."""
    d = cos.shape[-1]
    if not isinstance(y, list) and qk_norms is None:
        # q and k are adjacent columns of the one output: rotate them with one set of kernels
        qk = rope(y[..., : (heads + kv_heads) * d].view(*shape, heads + kv_heads, d), cos, sin)
        return qk[..., :heads, :], qk[..., heads:, :], y[..., (heads + kv_heads) * d :].view(*shape, kv_heads, d)
    q, k, v = members(y, p)
    q, k, v = q.view(*shape, heads, d), k.view(*shape, kv_heads, d), v.view(*shape, kv_heads, d)
    if qk_norms is not None:
        q, k = rms_norm(q, qk_norms[0]), rms_norm(k, qk_norms[1])
    return rope(q, cos, sin), rope(k, cos, sin), v


def before_attention(x: torch.Tensor, residual: torch.Tensor | None, norm, qkv: Proj, qk_norms, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, kv_heads: int, shape: tuple[int, ...] | None = None,
                     stack_kv: bool = False):
    """x [N, hidden] -> (x + residual, q [*shape, heads, D], kv): kv is (k, v), each [*shape, kv_heads, D], or with
    `stack_kv` one tensor [N, 2, kv_heads, D] (k then v: what `SlotKVCache.write` takes). `shape` defaults to (N,)."""
    if residual is not None:
        x = x + residual
    y = project(rms_norm(x, norm), qkv)
    q, k, v = qkv_heads(y, qkv, shape or (x.shape[0],), heads, kv_heads, qk_norms, cos, sin)
    return x, q, (torch.stack((k, v), dim=1) if stack_kv else (k, v))


def after_attention(x: torch.Tensor, attn: torch.Tensor, o: Proj, norm, gate_up: Proj, down: Proj, act):
    """x [N, hidden], attn [N, heads * D] -> (x + attn W_o, r): the residual stream after attention and the MLP's
    output, which the next layer adds."""
    x = x + project(attn, o)
    gate, up = members(project(rms_norm(x, norm), gate_up), gate_up)
    return x, project(act(gate) * up, down)
