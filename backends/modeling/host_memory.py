"""Host memory that the C allocator keeps after torch frees it, handed back to the operating system.

On the CPU, torch's tensors come from glibc's malloc. A training micro-batch allocates and frees hundreds of
activation tensors of a few MB each (SmolLM2-135M, 486 tokens: ~1.2 MB of saved activations per token, more in
transients); glibc keeps what is freed in its heaps, and measured here it did not reuse it for the next micro-batch
of the same shapes: resident memory grew by ~0.6 GB per micro-batch (0.46 -> 5.3 GB over 8 micro-batches of 486
tokens) and stayed there for the rest of the run. ``malloc_trim(0)`` returns every free page of every heap
(glibc >= 2.8), so resident memory follows what is live: with it before each micro-batch, 12 such micro-batches
stayed at 2.0-2.2 GB (benchmarks/results/memory-cpu.md). The price is that the next micro-batch takes its pages
fresh from the kernel again (zeroed on first touch), small beside the micro-batch's compute.

Elsewhere (macOS, musl) there is no ``malloc_trim`` and nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Give the pages malloc holds free back to the OS; True if it did (glibc), False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
