"""Which device a component runs on: 'auto' is CUDA when this process can see a GPU, else the CPU."""

from __future__ import annotations

import re

# How a device is spelled in a config: 'auto', 'cpu', 'cuda' (the current GPU) or 'cuda:K' (GPU K of this process).
DEVICE_SPELLING = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_spelling(device: str) -> str:
    """`device` if it is spelled as DEVICE_SPELLING says, else a ValueError naming the spellings."""
    if not isinstance(device, str) or not DEVICE_SPELLING.fullmatch(device):
        raise ValueError(f"expected auto, cpu, cuda or cuda:K (K a GPU index), got {device!r}")
    return device


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; anything else is returned as given ('cuda:1', 'cpu')."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
