"""Which packed attention a micro-batch runs: the trainer's ``attention_kernel`` resolved for its device and dtype,
then, for 'auto' on CUDA, chosen per micro-batch by its rows' lengths.

Two costs compete (benchmarks/results/training-h200.md, varlen-h200.md, on the H200):

- the ``rows`` path makes one SDPA call per row and layer, each with a fixed host cost: at the main job's shape
  (~500 rows of ~40 tokens a micro-batch) that is what made the update 2.22 s, against 0.30 s with ONE ``varlen``
  call per layer;
- on long rows the attention kernel itself is the cost: at rows of 2k-16k tokens cuDNN (the ``rows`` path, cuDNN
  first, rows padded to a multiple of the bucket b so its plans are reused) took 726 ms of GPU time per step for the
  attention forward + backward against 1,260 ms for FlashAttention-2 varlen (1.74x; steps 1.12-1.17x faster).

The rule for 'auto' where varlen can run, with T = ``TrainerConfig.long_row_tokens`` and the micro-batch's R rows
of n_r tokens:

    path(micro-batch) = rows with cuDNN, bucket b    if sum_r n_r^2 >= R * T^2   (the rows' quadratic mean >= T)
                        varlen                         otherwise

Why the quadratic mean: what cuDNN saves grows with each row's attention FLOPs (n_r^2), what the per-row calls cost
the host grows with R, so the rows' mean n^2 against T^2 weighs one against the other. Long rows topped up with a
few short ones (first-fit-decreasing bins: rows of 14,386, 8,101 and 1,731 tokens) run on cuDNN, where a rule on the
shortest row sent them to varlen, which took 10.3 ms per layer for such a micro-batch on the H200 against ~6 on cuDNN
(``benchmarks/results/ragged-attention-h200.json``: 8.45 against 6.47 ms for rows of 377-12,007 tokens). Many short
rows (the main job's ~500 of ~40 tokens) and one long row among many short ones stay on varlen. The padding stays
bounded: a row of n padded to at most n + b adds at most 2nb + b^2 FLOPs, so over the micro-batch at most
``(2b mean(n) + R b^2) / sum(n^2) <= 2b/T + (b/T)^2`` of its attention (0.56 at T = 2048, b = 512, below cuDNN's
1.74x), less as the mean grows. A row of the long mode can be any length from 1 token up, so the warm-up builds the
plans of every padded length b, 2b, ... within the budget.

Every other setting is one mode for every micro-batch, as before: 'varlen', 'flash', 'sdpa-default', 'cudnn', and
'auto' where varlen cannot run (float32, a torch without ``varlen_attn``); off CUDA the CPU's one path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.training.packed_attention import (PackedAttention, RowSpans, attention_path, bucketed,
                                               sdpa_backends)


@dataclass(frozen=True)
class AttentionMode:
    """One way to run a packed micro-batch's attention: the path (``packed_attention.PATHS``), SDPA's backends in
    priority order for the ``rows`` path (None: PyTorch's own) and the bucket rows are padded to (1: none)."""

    path: str
    sdpa_backends: list | None = None
    bucket: int = 1

    def packed(self, spans: RowSpans) -> PackedAttention:
        return PackedAttention(spans, self.path, self.sdpa_backends, self.bucket)


@dataclass(frozen=True)
class AttentionChoice:
    """A trainer's attention: ``usual`` for every micro-batch, except those whose rows' quadratic mean length is at
    least ``long_row_tokens``, which run ``long`` where there is one ('auto' on CUDA where varlen can run)."""

    usual: AttentionMode
    long: AttentionMode | None = None
    long_row_tokens: int | None = None

    @classmethod
    def fixed(cls, path: str, sdpa_order: list | None = None, bucket: int = 1) -> "AttentionChoice":
        """One mode for every micro-batch."""
        return cls(AttentionMode(path, sdpa_order, bucket))

    @classmethod
    def of(cls, kernel: str, device: torch.device, dtype: torch.dtype, bucket: int,
           long_row_tokens: int) -> "AttentionChoice":
        """The choice for an ``attention_kernel`` setting on ``device`` in ``dtype`` (ValueError where 'varlen'
        cannot run: ``attention_path``). The bucket applies to 'cudnn' on every device (the CPU pads as the GPU
        does, so CPU tests of a 'cudnn' trainer run the padding) and to 'auto''s long mode; SDPA's order is CUDA's
        only (the CPU has one kernel)."""
        path = attention_path(kernel, device, dtype)
        on_cuda = device.type == "cuda"
        usual = AttentionMode(path, sdpa_backends(kernel) if on_cuda else None,
                              bucket if kernel == "cudnn" and path == "rows" else 1)
        if kernel == "auto" and path == "varlen":
            return cls(usual, AttentionMode("rows", sdpa_backends("cudnn"), bucket), long_row_tokens)
        return cls(usual)

    def mode(self, lengths: Sequence[int]) -> AttentionMode:
        """The mode for a micro-batch of rows of these lengths (the rule in the module docstring)."""
        long = self.long is not None and lengths
        if long and sum(n * n for n in lengths) >= len(lengths) * self.long_row_tokens ** 2:
            return self.long
        return self.usual

    def packed(self, spans: RowSpans) -> PackedAttention:
        """What a packed forward over these spans passes its attention (``trajflow_packed``)."""
        return self.mode(spans.lengths).packed(spans)

    def padded_lengths(self, budget: int) -> tuple[AttentionMode | None, list[int]]:
        """The bucketed mode, if any, and every padded length a row of a micro-batch within ``budget`` tokens can
        run at on it: b, 2b, ..., ``bucketed(budget, b)`` ((None, []) where there is none, or where no micro-batch
        within the budget can be long: ``long_row_tokens`` over it). A row over the budget goes alone and is not
        counted."""
        if self.long is not None and self.long.bucket > 1:
            mode = self.long if self.long_row_tokens <= budget else None
        else:
            mode = self.usual if self.usual.bucket > 1 else None
        if mode is None:
            return None, []
        return mode, list(range(mode.bucket, bucketed(budget, mode.bucket) + 1, mode.bucket))

    def describe(self) -> str:
        """``usual``'s path, and the long mode's rule where there is one (for benchmarks' records)."""
        if self.long is None:
            return self.usual.path
        return f"{self.usual.path}; {self.long.path} (cudnn, bucket {self.long.bucket}) where the rows' quadratic " \
               f"mean >= {self.long_row_tokens} tokens"
