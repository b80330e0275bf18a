"""torch.compile of a decode step's two per-layer functions (`layer_math.before_attention` / `after_attention`),
with the eager functions as the fallback.

At batch 1 a decode step is its kernel count (~3 us a kernel inside a CUDA graph), so what compiling buys is fusion
of the pointwise glue between the matmuls: residual add + RMSNorm, RoPE + the q/k/v split + the stacking of k and v
for the cache write, LoRA's select, act(gate) * up. Choices:

1. Inductor's default mode, without its own CUDA graphs: `cuda_graphs.DecodeStep` captures the whole step, and a
   compiled function is plain kernel launches inside that capture. Matmuls stay cuBLAS (Inductor's extern kernels);
   attention and the cache write stay outside the compiled functions (eager, between them).
2. One compile serves every layer (the weights are arguments and the shapes are equal). Each runner compiles its own
   copies of the two functions (a fresh code object each), so dynamo's per-function recompile limit (8) counts one
   runner's variants only, whatever other runners or tests compiled before.
3. Shapes: batch 1 is compiled for itself (static); every larger batch shares one compile with a symbolic batch
   size, and LoRA's column count is symbolic too, so an adapter of another rank needs no compile. A static compile
   per batch bucket would be some 40 compiles at the default buckets: past the recompile limit, and minutes.
4. ``DecoderRunner.warm_up`` compiles every variant (batch 1 / larger, with / without LoRA, the first layer and the
   others) at engine start from dummy inputs of a decode step's shapes and layouts, so no request waits for it.
5. If compiling or running fails (no Triton, no C compiler, an op Inductor cannot lower), this runner goes eager
   for good with one warning; the maths is the same. Out-of-memory errors are raised.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch

from backends.inference.layer_math import after_attention, before_attention

log = logging.getLogger(__name__)


class LayerFunctions:
    """`before_attention` and `after_attention`, compiled for this runner when `compile`, else the eager ones."""

    EAGER: LayerFunctions

    def __init__(self, compile: bool):
        self.compile = compile
        self.failure: str | None = None
        self.compiles = 0  # graphs compiled by this runner's functions (warm-up included)
        self.compile_seconds = 0.0
        self.before_attention = self._guarded(before_attention) if compile else before_attention
        self.after_attention = self._guarded(after_attention) if compile else after_attention

    def active(self) -> LayerFunctions:
        """The functions a step should call: these, or the eager ones once compiling has failed."""
        return self if self.compile and self.failure is None else LayerFunctions.EAGER

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        t0 = time.perf_counter()
        try:
            return compile_fx(gm, example_inputs)
        finally:
            self.compile_seconds += time.perf_counter() - t0

    def _guarded(self, fn: Callable) -> Callable:
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                 fn.__closure__)  # choice 2: this runner's own dynamo cache
        compiled = torch.compile(own, backend=self._backend, dynamic=None, fullgraph=True)

        def run(*args):
            if self.failure is None:
                try:
                    return compiled(*args)
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the same maths runs eagerly; a real error re-raises there
                    self.failure = f"{type(exc).__name__}: {exc}"[:500]
                    log.warning("torch.compile of the decode step's %s failed, running it eagerly: %s",
                                fn.__name__, self.failure)
            return fn(*args)

        return run


LayerFunctions.EAGER = LayerFunctions(False)
