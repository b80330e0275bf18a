"""The engine's KV cache: one fixed slot per running sequence, static shapes so a decode step can be a CUDA graph.

Layout: ``data[layer, 0 (key) | 1 (value), slot, kv_head, position, head_dim]``. A sequence owns slot ``s`` from
admission to finish; position ``p`` of its cache holds the key/value of its token ``p``. Decode attends over
positions ``0..pos`` of its slot (a mask hides the rest), so stale values left by a previous owner are harmless
as long as they are finite, which is why the cache starts zeroed.

On CUDA the cache is one ``torch.zeros`` allocation. On the CPU it is an anonymous memory map (zero pages,
committed only when written) and a finished slot is handed back to the OS with ``madvise(MADV_DONTNEED)``, so
resident memory follows the tokens actually live rather than ``slots x max_len``.
"""

from __future__ import annotations

import mmap
import sys

import torch

_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


class SlotKVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` tokens each."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        shape = (num_layers, 2, num_slots, num_kv_heads, max_len, head_dim)
        self._mm: mmap.mmap | None = None
        if device.type == "cpu":
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = itemsize
            for d in shape:
                nbytes *= d
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            self._mm = mmap.mmap(-1, nbytes, flags=flags)
            self.data = torch.frombuffer(self._mm, dtype=dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self._slot_bytes = num_kv_heads * max_len * head_dim * self.data.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        """[slots, kv_heads, max_len, head_dim] keys of `layer` (a view)."""
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """[slots, kv_heads, max_len, head_dim] values of `layer` (a view)."""
        return self.data[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """Key and value of one token per row, in one indexed write: ``kv[b]`` ([2, kv_heads, head_dim], key then
        value) goes to position ``pos[b]`` of slot ``slots[b]`` of `layer`."""
        self.data[layer][:, slots, :, pos] = kv

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy positions [0, length) of slot `src` to each slot in `dsts` (n > 1 choices share their prompt)."""
        if not dsts:
            return
        index = torch.tensor(dsts, device=self.data.device)
        part = self.data[:, :, src : src + 1, :, :length]
        self.data[:, :, :, :, :length].index_copy_(2, index, part.expand(-1, -1, len(dsts), -1, -1, -1))

    def release(self, slot: int) -> None:
        """Slot `slot` is free again; on the CPU give its pages back (they read as zeros afterwards)."""
        if self._mm is None:
            return
        per_kind = self.num_slots * self._slot_bytes
        for block in range(self.num_layers * 2):
            start = block * per_kind + slot * self._slot_bytes
            lo = -(-start // _PAGE) * _PAGE
            hi = (start + self._slot_bytes) // _PAGE * _PAGE
            if hi > lo:
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    @property
    def nbytes(self) -> int:
        """Size of the whole cache (virtual size on the CPU)."""
        return self.data.numel() * self.data.element_size()

    def close(self) -> None:
        """Drop the storage (the engine is shutting down)."""
        self.data = None  # type: ignore[assignment]
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the OS reclaims it with the process
                pass
            self._mm = None
