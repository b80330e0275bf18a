"""One adapter merged into the base weights, for decode steps whose rows all use that adapter
(`EngineConfig.merged_single_adapter`).

For every projection group ``g`` of every layer (q/k/v, o, gate/up, down; `lora_slots.GROUPS`) and the adapter in
LoRA slot ``s`` (A and B read from the slot stacks, scale folded into B):

    W'_g = dtype(W_g + (A_g,s @ B_g,s).T)          computed in float32, rounded once to the serving dtype

so such a step runs the base model's no-LoRA forward on ``W'`` (one GEMM per group, no LoRA kernels), where the LoRA
path computes ``x W_g^T + (x A) B``. The result differs by one rounding: ``W'`` is rounded to the serving dtype where
the LoRA path rounds ``x W^T`` and ``x A`` instead (in float32, float rounding only; in bf16 the logprobs of
tiny-random with a random rank-8 LoRA move by up to 0.016, tests/unit/backends/inference/test_merged_weights.py).

Choices:

1. One buffer set, allocated once: a tensor per group (or per member where the group's projections are separate
   matmuls) shaped as the base weight, for every group of every layer, i.e. a second copy of the LoRA'd projections
   (all seven of them: the slots cover all seven whatever an adapter targets). With LoRA's A fused into the base
   GEMM only the base rows of ``W_ext`` are merged. Biases are the base model's (LoRA leaves them alone).
2. Which slot the buffers hold, and that slot's fill number (`LoraSlots.fills`, new whenever an adapter is written
   into the slot or the stacks are reallocated), are kept; `hold(s)` rebuilds the buffers in place (``copy_`` into
   the same storage) when they hold anything else, so CUDA graphs captured on them stay valid: one graph serves
   every slot.
3. A rebuild overwrites weights that a step still on the device may read: the engine never rebuilds while a merged
   step is in flight (it drains that step first, `Engine._decode`). On CUDA a rebuild is queued on the engine's
   stream like a step; its time (`seconds`) is the host's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from backends.inference.layer_math import Proj
from backends.inference.lora_slots import LoraSlots


class MergedWeights:
    """Merged copies of `groups` (per layer: group name -> the decoder's projection group, whose ``operands(None)``
    gives its base `Proj`) for the adapter of one slot of `lora`."""

    def __init__(self, groups: list[dict], lora: LoraSlots):
        self.groups, self.lora = groups, lora
        self.held: tuple[int, int] | None = None  # (slot, its fill number) the buffers were built from
        self.rebuilds = 0
        self.seconds = 0.0
        with torch.inference_mode(False):  # ordinary tensors, like the base weights (compiled code's guards)
            self._projs = [{name: self._allocate(group.operands(None)) for name, group in layer.items()}
                           for layer in groups]

    @staticmethod
    def _allocate(base: Proj) -> Proj:
        if base.parts is not None:
            return base._replace(parts=tuple((torch.empty_like(w), b) for w, b in base.parts))
        return base._replace(weight=torch.empty_like(base.weight))

    def tensors(self) -> list[torch.Tensor]:
        """The buffer set: every merged weight matrix."""
        return [w for layer in self._projs for p in layer.values() for w in _weights(p)]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.tensors())

    def operands(self, layer: int) -> Callable[[str], Proj]:
        """Layer `layer`'s merged `Proj` per group (no LoRA term)."""
        return self._projs[layer].__getitem__

    def holds(self, slot: int) -> bool:
        """Whether the buffers hold the adapter now in `slot`."""
        return self.held == (slot, self.lora.fills[slot])

    @torch.no_grad()
    def hold(self, slot: int) -> bool:
        """Make the buffers hold the adapter in `slot` (a rebuild in place unless they already do); True if rebuilt."""
        if self.holds(slot):
            return False
        t0 = time.perf_counter()
        for layer, projs in enumerate(self._projs):
            for name, merged in projs.items():
                a, b = self.lora.slot_factors(layer, name, slot)
                a_t = a.t().float()
                row = 0
                for dst, src in zip(_weights(merged), _weights(self.groups[layer][name].operands(None))):
                    rows = src.shape[0]
                    dst.copy_(torch.addmm(src.float(), b[:, row : row + rows].t().float(), a_t))
                    row += rows
        self.held = (slot, self.lora.fills[slot])
        self.rebuilds += 1
        self.seconds += time.perf_counter() - t0
        return True


def _weights(p: Proj) -> list[torch.Tensor]:
    """A group's weight matrices, in the order of its output columns."""
    return [w for w, _ in p.parts] if p.parts is not None else [p.weight]
