"""Where a Triton kernel of ours can be launched: on a CUDA tensor, or on a CPU one under Triton's interpreter.

    launchable(t) = t on CUDA  or  (t on the CPU and TRITON_INTERPRET=1)

The interpreter runs a kernel's Python body on CPU tensors (slowly, in float32 where the tests widen the dtypes): that
is how CI checks the kernels without a GPU. The variable is read at each call, as triton itself reads it at import.
"""

from __future__ import annotations

import os

import torch


def launchable(t: torch.Tensor) -> bool:
    """True on CUDA, and on the CPU where ``TRITON_INTERPRET=1`` (module docstring)."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
