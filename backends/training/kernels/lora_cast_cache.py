"""The compute-dtype copies of the LoRA weights, made once per optimizer step instead of once per micro-batch.

A fused LoRA op (``fused_lora._LoraLinear``, ``lean_ops._LoraSwiGLU``) computes with, for fp32 masters A, B, the
scaling s and the compute dtype c:

    A_c = A.to(c),   (sB)_c = (s * B).to(c)

three small kernels per LoRA module (a cast of A, the product s*B, its cast). Between two optimizer steps A and B do
not change, so every micro-batch of a step would make the same copies: on the H200 at the 1.5B shape, 196 modules x
~9 micro-batches x 3 = ~5,300 launches a step for what 588 make.

Choice: ``CastCache`` keeps one (A_c, (sB)_c) per module and compute dtype, only while a scope is open
(``GRPOTrainer`` opens one around a step's micro-batches, KL reference passes included, and closes it before the
optimizer step). Each entry is stamped with A's and B's storage pointers and ``_version`` counters (every in-place
write through the parameter itself bumps its counter: ``optimizer.step``, ``load_state_dict``'s ``copy_``), and s,
so an entry whose parameters changed inside a scope is re-made, never reused. The scope is the second guard: a write
through ``.data`` (``distributed.broadcast_parameters``) bumps no counter, and no entry outlives the step it was made
in. Outside a scope (no cache, or a closed one) the copies are made per call, as before.

The copies carry no autograd history (made inside ``autograd.Function.forward``); the gradients still go to the fp32
masters, which the ops receive as inputs.
"""

from __future__ import annotations

import contextlib

import torch


def cast_lora(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dtype: torch.dtype):
    """(A_c, (sB)_c): A in the compute dtype, and B with its scaling folded in, in the compute dtype."""
    return lora_a.to(dtype), (lora_b * scaling).to(dtype)


class CastCache:
    """(A_c, (sB)_c) per LoRA module while ``scope()`` is open; counts what it made (``fills``) and reused
    (``hits``)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[tuple, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._open = False
        self.fills = self.hits = 0

    @contextlib.contextmanager
    def scope(self):
        """Reuse copies inside the block; none survive it."""
        self._entries.clear()
        self._open = True
        try:
            yield self
        finally:
            self._open = False
            self._entries.clear()

    def lora(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dtype: torch.dtype):
        """(A_c, (sB)_c), reused while the scope is open and A, B and s are what they were when it was made."""
        if not self._open:
            return cast_lora(lora_a, lora_b, scaling, dtype)
        key = (id(lora_a), id(lora_b), dtype)
        stamp = (lora_a.data_ptr(), lora_a._version, lora_b.data_ptr(), lora_b._version, float(scaling))
        entry = self._entries.get(key)
        if entry is not None and entry[0] == stamp:
            self.hits += 1
            return entry[1]
        copies = cast_lora(lora_a, lora_b, scaling, dtype)
        self._entries[key] = (stamp, copies)
        self.fills += 1
        return copies


def lora_casts(cache: CastCache | None, lora_a, lora_b, scaling: float, dtype: torch.dtype):
    """(A_c, (sB)_c) through ``cache`` where there is one, else made now."""
    return cast_lora(lora_a, lora_b, scaling, dtype) if cache is None else cache.lora(lora_a, lora_b, scaling, dtype)
