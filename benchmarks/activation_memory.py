"""How many bytes autograd keeps for the backward pass of a forward call (lean-op tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, not counting tensors that share
    data with ``exclude`` (parameters, which exist anyway). Each storage is counted once."""
    skip = {t.data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())
