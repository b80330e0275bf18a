"""A fused LoRA op that reads an RMSNorm's output keeps the norm's inputs instead (``TrainerConfig.recompute_norm``).

The lean RMSNorm (``lean_ops._RMSNorm``) keeps, for its own backward, its input x and rstd; its output

    n = w * (x * rstd).to(dtype),   rstd = 1 / sqrt(mean(x^2) + eps)   (float32 inside)

is an elementwise function of those and of its weight w. The ops that read n (a decoder layer's q, k and v after
input_layernorm, its MLP after post_attention_layernorm) need n for their LoRA dL/dA = dz^T n; kept as it is, n is one
more [T, hidden] tensor per norm, ~10% of a layer's saved activations at the Qwen2.5-1.5B shape (2 x 3 KB of ~58 KB per
token and layer in bf16). With this on they keep (x, w, rstd), the very tensors the norm keeps (no new storage),
and recompute n in their backward with the forward's own elementwise formula (``normalized``, compiled on CUDA like
the norm, whose kernel computes rstd and then n by it): the same bits, so the loss and every gradient are identical
to the option off (compared with ``torch.equal`` on the CPU, eager, and on an H200, compiled; there fp8_base's
steps were not, so the two never run together). The price is one elementwise pass over [T, hidden] per norm in
backward (reading x, writing n), two per layer: the ops that read one norm's output share its recomputation
(``Recompute``; q, k and v's backwards run one after another). Counted at the Qwen2.5-1.5B shape (bf16, CUDA
defaults): 61,624 -> 55,480 bytes per token and layer (``benchmarks/results/norm-recompute-cpu.md``); on the H200,
with one pass per reading op (four a layer), 16k-token micro-batches lost 2.3% of tokens/s.

Choices:

1. How an op finds the norm: the norm attaches a ``NormSource`` to its output tensor (``mark``), so whichever fused op
   is handed that very tensor can keep the source instead; no wiring per decoder layout (q, k, v, the grouped q/k/v
   op and the MLP all read the norm's output as it is), and no Python runs per saved tensor (as a
   ``saved_tensors_hooks`` pack would, for every tensor of every op). The record lives exactly as long as the output
   and is trusted only while the output's version counter is the one it had (nothing wrote it in place since).
   Marked only where the norm itself was recorded (its output requires grad, so it keeps x and rstd): a no-grad
   pass (KL reference, evaluation) keeps nothing anyway, and where the norm's input and weight are frozen (the first
   layer) the norm keeps nothing either: keeping its x instead of n would save no bytes.
2. Where a folded op (``fold_lora_b``, ``group_qkv``) kept xz = [n | z] for n and its z = n A^T, it keeps z alone
   (rank-sized: the fold's own product, not a view of xz, so xz itself is freed after the forward).
3. Ops that are not the fused ones (peft's path: an adapter disabled, a non-fusable module) ignore the record and
   keep n as before: same function, no saving.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import torch

from backends.training.kernels.chain_input_grads import InputGradSum
from backends.training.kernels.torch_compile import kernel


def normalized(x, weight, rstd):
    """n = w * (x * rstd).to(x.dtype), rstd float32 ([..., 1]): the norm's output from its saved inputs."""
    return weight * (x.float() * rstd).to(x.dtype)


class Recompute:
    """One norm output's recomputation, shared by the ops that kept its source (q, k and v read the same output): the
    first of their backwards computes n, the others reuse it, the last drops it. Holds no input tensor (only n, and
    only between those backwards), so it may live on an op's ctx without keeping activations alive. ``input_grads``:
    where the readers sum their input gradients (``chain_input_grads``), handed to the norm's backward."""

    __slots__ = ("compile", "users", "n", "input_grads")

    def __init__(self, compile: bool):
        self.compile, self.users, self.n, self.input_grads = compile, 0, None, InputGradSum()


@dataclass(frozen=True)
class NormSource:
    """What a norm's output n is made of: its input ``x``, ``weight``, ``rstd``, and the recomputation its readers
    share (with ``compile``: whether the norm's kernel is compiled, so the recomputation's is too)."""

    x: torch.Tensor
    weight: torch.Tensor
    rstd: torch.Tensor
    compile: InitVar[bool]
    shared: Recompute = field(init=False, compare=False)

    def __post_init__(self, compile: bool):
        object.__setattr__(self, "shared", Recompute(compile))


def mark(n: torch.Tensor, source: NormSource) -> torch.Tensor:
    """Attach ``source`` to the norm output ``n`` (stamped with n's version) where the norm was recorded; returns n."""
    if n.requires_grad:
        n._trajflow_norm = (n._version, source)
    return n


def source_of(n: torch.Tensor) -> NormSource | None:
    """The ``NormSource`` of a marked norm output not written since it was marked, else None."""
    record = getattr(n, "_trajflow_norm", None)
    return record[1] if record is not None and record[0] == n._version else None


def keep(x2: torch.Tensor, source: NormSource | None) -> tuple:
    """The three tensors an op saves for its 2-D input x2: the norm's (x, w, rstd) where x2 is a norm's output
    (``source``; the op is counted as one more reader of its recomputation), else (x2, None, None)."""
    if source is None:
        return x2, None, None
    source.shared.users += 1
    return source.x, source.weight, source.rstd


def shared(source: NormSource | None) -> Recompute | None:
    """What an op hands to ``restore``: the source's shared recomputation, None when it kept its input itself."""
    return None if source is None else source.shared


def restore(kept, dtype: torch.dtype, recompute: Recompute | None) -> torch.Tensor:
    """x2 again from ``keep``'s three tensors: recomputed with the forward's kernel in the op's compute dtype, once
    for all the ops that kept the same norm's source (the last of them drops it)."""
    x, weight, rstd = kept
    if weight is None:
        return x
    n = recompute.n
    if n is None or n.dtype != dtype:
        n = kernel(normalized, recompute.compile)(x, weight, rstd).reshape(-1, x.shape[-1]).to(dtype)
    recompute.users -= 1
    recompute.n = n if recompute.users > 0 else None
    return n


def restore_folded(kept, z: torch.Tensor | None, in_features: int, dtype: torch.dtype,
                   recompute: Recompute | None):
    """(x2, z) of a folded op that saved ``keep(xz, None)`` and no z, or ``keep(x2, source)`` and its z."""
    x = restore(kept, dtype, recompute)
    return (x[:, :in_features], x[:, in_features:]) if z is None else (x, z)
