"""One decode step (forward + sampling) for rows 0..B-1, eager or replayed from a captured CUDA graph.

Inputs go through one static buffer ``[6, max_batch]`` float64 (token, position, LoRA slot, temperature, top-p,
uniform draw; float64 holds token ids exactly) copied to the device in one transfer; outputs come back as one
``[2, B]`` tensor (token, raw logprob) in one transfer, plus the raw logprobs ``[B, V]`` left on the device for
``top_logprobs``.

With CUDA graphs, a step runs at a bucketed batch (the smallest of ``batch_buckets`` covering the highest slot in
use; rows past the live ones are idle and write only to free slots) and a bucketed attention length (a power of two
>= the longest live position), so a handful of graphs serve all traffic. A graph is captured the first time its
(batch, length, with-LoRA, with-top-p) combination is needed, from the real inputs of that step: the warm-up and
capture runs repeat the very same computation, so their cache writes are idempotent. Eagerly (the CPU), a step uses
the exact batch and length.
"""

from __future__ import annotations

import torch

from backends.inference.decoder import DecoderRunner
from backends.inference.sampling import sample

ROWS = ("token", "pos", "lora", "temperature", "top_p", "uniform")


def default_batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_batch (and max_batch itself)."""
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_batch + 1, 16)] if b < max_batch} | {max_batch})


class DecodeStep:
    """Runs decode steps on `runner`; `graphs` turns CUDA graph capture on."""

    def __init__(self, runner: DecoderRunner, max_batch: int, max_len: int, graphs: bool):
        self.runner, self.max_batch, self.max_len = runner, max_batch, max_len
        self.graphs = graphs
        device = runner.device
        self.host = torch.zeros((len(ROWS), max_batch), dtype=torch.float64,
                                pin_memory=device.type == "cuda")
        self.dev = torch.zeros((len(ROWS), max_batch), dtype=torch.float64, device=device)
        self.batch_buckets = default_batch_buckets(max_batch)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._generation = runner.lora.generation
        self._pool = None
        self.captures = 0

    def bucket(self, rows: int, length: int) -> tuple[int, int]:
        """(batch, attention length) a step over `rows` rows reaching position `length - 1` runs at."""
        if not self.graphs:
            return rows, length
        batch = next(b for b in self.batch_buckets if b >= rows)
        span = 128
        while span < length:
            span *= 2
        return batch, min(span, self.max_len)

    def _body(self, batch: int, length: int, lora: bool, top_p: bool, lora_slots: int | None = None):
        d = self.dev[:, :batch]
        tokens, pos = d[0].long(), d[1].long()
        lora_rows = d[2].long() if lora else None
        logits = self.runner.decode(tokens, pos, length, lora_rows, lora_slots)
        toks, lps, raw = sample(logits, d[3].float(), d[5], d[4].float() if top_p else None)
        return torch.stack((toks.double(), lps.double())), raw

    def run(self, batch: int, length: int, lora: bool, top_p: bool,
            lora_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step rows 0..batch-1 from `self.host` (already filled); returns ([2, batch] on the CPU, raw [batch, V]).
        Eagerly, LoRA columns are read only for slots < `lora_slots`; a graph always covers every slot."""
        self.dev.copy_(self.host, non_blocking=True)
        if self.runner.lora.generation != self._generation:
            # LoRA stacks were reallocated: old graphs are stale, compiled layer functions need these stacks' variant
            self.clear()
            self._generation = self.runner.lora.generation
            self.runner.warm_up()
        if not self.graphs:
            out, raw = self._body(batch, length, lora, top_p, lora_slots)
            return out.cpu(), raw
        key = (batch, length, lora, top_p)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key)
        graph, out, raw = entry
        graph.replay()
        return out.cpu(), raw

    def _capture(self, key: tuple) -> tuple:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer may run CUDA work on another thread meanwhile (the async pipeline trains while
        # later steps' rollouts decode); the default ("global") makes any such call invalidate this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out, raw = self._body(*key)
        self._graphs[key] = (graph, out, raw)
        self.captures += 1
        return self._graphs[key]

    def clear(self) -> None:
        """Drop every graph and their memory pool: a pool whose graphs are all freed cannot take new captures
        (PyTorch asserts ``use_count > 0`` in capture_begin), so the next capture starts a fresh pool."""
        self._graphs.clear()
        self._pool = None
