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

from collections.abc import Sequence
from dataclasses import dataclass

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


def make_micro_batch(rows: Sequence[TrainingRow], device) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    pred: list[int] = []
    tgt: list[int] = []
    lps: list[float] = []
    adv: list[float] = []
    wts: list[float] = []
    ridx: list[int] = []
    for k, row in enumerate(rows):
        offset = len(ids)
        if row.loss_mask and row.loss_mask[0]:
            raise ValueError(f"{row.source}: the first token of a row cannot be trained (no context before it)")
        for t, trained in enumerate(row.loss_mask):
            if trained:
                pred.append(offset + t - 1)
                tgt.append(row.token_ids[t])
                lps.append(row.sampler_logprobs[t])
        n = row.trained_tokens
        adv += [row.advantage] * n
        wts += [row.weight] * n
        ridx += [k] * n
        ids += row.token_ids
        pos += range(len(row))

    lengths = [len(r) for r in rows]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ints = to_device(torch.tensor(ids + pos + pred + tgt + ridx + offsets, dtype=torch.long), device)
    floats = to_device(torch.tensor(lps + adv + wts, dtype=torch.float32), device)
    n_tok, n_trained = len(ids), len(pred)
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
