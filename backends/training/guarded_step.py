"""The optimizer step queued behind the last backward, skipped on the device where the step is not finite.

A step's update needs two verdicts: its loss L = sum of the micro-batches' losses and its clipped gradient norm
||g|| must both be finite. Read on the host first, they make the optimizer's kernels wait for that read: the GPU
idles while the host gets the values back, then launches the update's kernels. Queued instead:

    found_inf = 1 - [isfinite(L) and isfinite(||g||)]    (a float32 scalar on the device)

and the fused AdamW (``torch.optim.AdamW(fused=True)``, the trainer's on CUDA) reads ``found_inf`` as GradScaler's
contract has it: where it is 1 its kernel leaves the parameters, both moments and the step counts as they were.
So the update runs right behind the backward, and the host's read of the metrics afterwards is the step's one wait.
Where the verdict is "not finite" the trainer still raises (after that read) and the skipped update has changed
nothing, as the host-first order did; only the optimizer's per-parameter state comes into being on a first step that
was skipped (zero moments, step 0: what a fresh state would be).

Choices: only for an optimizer whose step takes ``found_inf`` (``fused``; the foreach and for-loop AdamW ignore it)
and in one process (data-parallel reduces the gradients and sums over the ranks on the host's schedule first);
elsewhere the trainer reads first and steps after (``guards``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def guards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` skips its update on the device where ``found_inf`` is set (a fused AdamW/Adam)."""
    return bool(optimizer.defaults.get("fused"))


def queue_guarded_step(optimizer: torch.optim.Optimizer, losses: Sequence[torch.Tensor], norm: torch.Tensor) -> None:
    """``optimizer.step()`` launched now, a no-op on the device unless the sum of ``losses`` and ``norm`` are both
    finite (module docstring); reads nothing back."""
    finite = torch.isfinite(torch.stack([loss.detach().float() for loss in losses]).sum()) & torch.isfinite(norm)
    optimizer.found_inf = (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
