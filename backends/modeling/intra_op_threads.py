"""One intra-op thread for short, single-sequence passes on the CPU (the publish probe, the policy-shift pass).

Rule: a no-grad pass over one sequence on the CPU (a greedy decode of a few tokens, a scoring forward) runs with
one intra-op thread; everything else keeps torch's setting. Such a pass is a chain of small ops, each a parallel
region whose threads meet at a barrier: when another process holds one of the cores, the thread that waits for it
stalls every op (measured on the project's 2-core machine, other work running: the probe passes of the tiny-random
trainer took 0.03 s with one thread and up to 0.97 s with two; on SmolLM2-135M 3.6 s against 11-13 s). One thread
never waits for another. The training update itself, large batched matrix products, keeps every thread.

``torch.set_num_threads`` is process-wide for the math libraries (MKL), so another thread's CPU torch work in that
window also runs on one thread; the setting is restored when the pass ends. Only speed changes, never a result
beyond float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def single_thread_on_cpu(device) -> Iterator[None]:
    """Run the block with one intra-op thread when `device` (a torch.device or its name) is the CPU."""
    import torch

    if torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
