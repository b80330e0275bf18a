"""Which device a component runs on: 'auto' is CUDA when this process can see a GPU, else the CPU."""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; anything else is returned as given ('cuda:1', 'cpu')."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
