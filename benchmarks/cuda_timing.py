"""Median CUDA-event time of a callable, for the GPU kernel benchmarks.

    median_ms(fn, reps) = the middle (upper middle for an even count) of ``reps`` times of ``fn()`` between two CUDA
    events, each followed by a device sync, after 3 unrecorded calls (compiles, autotuning, allocator growth).
"""

from __future__ import annotations

import torch


def median_ms(fn, reps: int = 15) -> float:
    """Median milliseconds of one ``fn()`` on the current CUDA stream (module docstring)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
