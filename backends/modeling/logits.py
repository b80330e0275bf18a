"""Vocabulary logits in float32 from bf16 (or fp32) hidden states: the one projection the sampler and trainer share.

logits = h W^T with float32 OUTPUT. A bf16 logit of magnitude 16-32 is rounded to a multiple of 0.125,
so two implementations that round their logits independently can disagree by ~0.1 nat on a token's
logprob before any other difference (seen on an H200: the embedded engine and the trainer, both bf16,
differed by up to 0.095 on an 8-token probe). The product still runs on the tensor cores (bf16 inputs,
float32 accumulate, as always) and only skips the final rounding: ``torch.mm(..., out_dtype=float32)``
on CUDA; float32 inputs need nothing; elsewhere the inputs are upcast (slow, only a CPU bf16 path).
MiniMax-M1 (2025) reports the same fix for its training/inference probability mismatch.
"""

from __future__ import annotations

import torch

_MM_OUT_DTYPE: list[bool] = []  # whether torch.mm(out_dtype=float32) worked here (decided on first use)


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] @ weight[V, H]^T -> float32 [..., V]."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return hidden @ weight.t()
    flat = hidden.reshape(-1, hidden.shape[-1])
    if hidden.is_cuda and _MM_OUT_DTYPE != [False]:
        try:
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE[:] = [True]
            return out.view(*hidden.shape[:-1], weight.shape[0])
        except (RuntimeError, TypeError, NotImplementedError):  # older torch: no out_dtype for mm
            _MM_OUT_DTYPE[:] = [False]
    return (flat.float() @ weight.float().t()).view(*hidden.shape[:-1], weight.shape[0])
