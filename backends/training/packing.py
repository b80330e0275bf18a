"""Micro-batches packed without padding.

Rows are placed first-fit-decreasing into bins of at most ``micro_batch_tokens`` tokens (a longer row
gets a bin of its own) and each bin runs as ONE sequence of batch size 1: no padding token is ever
computed. Positions restart at 0 for every row, and the rows' spans (``RowSpans``: lengths, and the cumulative
offsets on the device, built once here) keep each row's attention to itself (``packed_attention``), which is
exactly what each row alone would compute.

A micro-batch reaches the device in two copies, its integers and its floats, each one tensor in pinned memory copied
without waiting on CUDA; its fields are slices of those two. Nine separate copies from pageable memory (one per
field) made the host wait for the stream nine times per micro-batch (``cudaStreamSynchronize``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backends.training.packed_attention import RowSpans
from backends.training.token_rows import TrainingRow


def plan_bins(lengths: Sequence[int], budget: int, pack: bool = True) -> list[list[int]]:
    """Row indices per micro-batch: first-fit decreasing under ``budget`` tokens (ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not pack:
        return [[i] for i in order]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


@dataclass
class MicroBatch:
    """One packed forward: the tokens, their positions and the rows' spans, and the trained positions' data.

    ``pred_index[j]`` is the position whose hidden state predicts trained token ``targets[j]``
    (the position just before it); ``row_index[j]`` says which of ``rows`` it belongs to.
    """

    rows: list[TrainingRow]
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    spans: RowSpans
    pred_index: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    sampler_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]
    row_index: torch.Tensor  # [N]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def sources(self) -> str:
        return "; ".join(r.source for r in self.rows)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` on ``device``; to CUDA from pinned memory with ``non_blocking`` (torch's pinned allocator keeps the
    buffer until the copy is done), so the host does not wait for the stream."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _trained_positions(mask: Sequence) -> np.ndarray:
    """Indices of the true entries of ``mask``: ``bytes`` reads a list of bools in one C loop; other entries (numpy
    bools) by their truth value."""
    try:
        flags = np.frombuffer(bytes(mask), dtype=np.uint8)
    except (TypeError, ValueError):
        flags = np.fromiter(map(bool, mask), dtype=bool, count=len(mask))
    return np.flatnonzero(flags)


def make_micro_batch(rows: Sequence[TrainingRow], device) -> MicroBatch:
    """``rows`` back to back as one micro-batch on ``device``.

    With o_k the offset of row k and T_k its trained positions (mask 1): input_ids = the rows' ids, position_ids =
    0..len-1 per row, pred_index = o_k + t - 1 and targets = ids[t] for t in T_k, row by row; sampler_logprobs at
    T_k, and the row's advantage, weight and index repeated |T_k| times.

    Each row's lists are read once, whole, into arrays (its ids through ``array``, its mask through ``bytes``: C
    loops), and the rest is numpy on those arrays; a Python loop over every token, then ``torch.tensor`` of ~300k
    Python numbers, made the first micro-batch of a step cost ~7x more host time while the GPU waited.
    """
    lengths = [len(r) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids, pred, tgt, lps, counts = [], [], [], [], []
    for k, row in enumerate(rows):
        if row.loss_mask and row.loss_mask[0]:
            raise ValueError(f"{row.source}: the first token of a row cannot be trained (no context before it)")
        row_ids = np.frombuffer(array("q", row.token_ids), dtype=np.int64)
        trained = _trained_positions(row.loss_mask)
        ids.append(row_ids)
        pred.append(trained + (offsets[k] - 1))
        tgt.append(row_ids[trained])
        lps.append(np.frombuffer(array("d", row.sampler_logprobs), dtype=np.float64)[trained])
        counts.append(len(trained))
    n_tok, n_trained = int(offsets[-1]), sum(counts)
    pos = np.arange(n_tok, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    ridx = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    # float64 until the one cast to float32, so each value is rounded once, as torch.tensor of Python floats does
    per_row = np.array([(r.advantage, r.weight) for r in rows], dtype=np.float64).reshape(-1, 2)
    adv, wts = np.repeat(per_row[:, 0], counts), np.repeat(per_row[:, 1], counts)
    ints = to_device(torch.from_numpy(np.concatenate([*ids, pos, *pred, *tgt, ridx, offsets])), device)
    floats = to_device(torch.from_numpy(np.concatenate([*lps, adv, wts]).astype(np.float32)), device)
    ids_d, pos_d, pred_d, tgt_d, ridx_d, offsets_d = ints.split([n_tok, n_tok, n_trained, n_trained, n_trained,
                                                                  len(offsets)])
    lps_d, adv_d, wts_d = floats.split([n_trained] * 3)
    return MicroBatch(
        rows=list(rows),
        input_ids=ids_d[None],
        position_ids=pos_d[None],
        spans=RowSpans(tuple(lengths), offsets_d.to(torch.int32), max(lengths, default=0)),
        pred_index=pred_d,
        targets=tgt_d,
        sampler_logprobs=lps_d,
        advantages=adv_d,
        weights=wts_d,
        row_index=ridx_d,
    )
