"""The slot KV cache's one-call write of a decode step's keys and values."""

from __future__ import annotations

import torch

from backends.inference.kv_cache import SlotKVCache


def test_joint_write_puts_each_rows_key_and_value_at_its_slot_and_position():
    cache = SlotKVCache(num_layers=2, num_slots=4, num_kv_heads=2, max_len=8, head_dim=3, dtype=torch.float32,
                        device=torch.device("cpu"))
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([5, 1, 7])
    kv = torch.randn(3, 2, 2, 3)  # [rows, key|value, kv_heads, head_dim]
    cache.write(1, slots, pos, kv)
    for b in range(3):
        torch.testing.assert_close(cache.keys(1)[slots[b], :, pos[b]], kv[b, 0], rtol=0, atol=0)
        torch.testing.assert_close(cache.values(1)[slots[b], :, pos[b]], kv[b, 1], rtol=0, atol=0)
    assert int((cache.data != 0).sum()) == kv.numel()  # nothing else written: not layer 0, not other positions
    cache.close()
