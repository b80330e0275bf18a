"""The phases of a trainer step as a profiler's trace names them, so a profile says which phase a kernel or a gap of
the GPU belongs to (``benchmarks/profile_gaps.py``).

Each phase is a ``torch.profiler.record_function`` range on the thread that runs the step: ``PREPARE`` (rows,
advantages, aggregation weights, the micro-batches' bins), ``MICRO_BATCH`` (one per micro-batch: its packing,
forward, loss, backward; the backward's launches run on the autograd engine's thread meanwhile), ``UPDATE`` (gradient
norm, the metrics' read, optimizer and scheduler step). Outside a profiler a range costs about a microsecond, a few
per step.
"""

from __future__ import annotations

import torch

PREPARE = "trajflow.step.prepare"
MICRO_BATCH = "trajflow.step.micro_batch"
UPDATE = "trajflow.step.update"
PHASES = (PREPARE, MICRO_BATCH, UPDATE)


def phase(name: str):
    """A context manager marking ``name`` (one of ``PHASES``) in a profiler's trace."""
    return torch.profiler.record_function(name)
