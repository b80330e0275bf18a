"""One decode step (forward + sampling) for rows 0..B-1, eager or replayed from a captured CUDA graph.

Inputs go through one static buffer ``[6, max_batch]`` float64 (token, position, LoRA slot, temperature, top-p,
uniform draw; float64 holds token ids exactly) copied to the device in one transfer; outputs come back as one
``[2, B]`` tensor (token, raw logprob) in one transfer, plus the top-k raw logprobs of the rows that ask for them.

A step is *launched* (`DecodeStep.launch`): its input copy, forward, sampling and output copies are queued on the
device's stream and the call returns; `Launched.fetch` waits for it. The engine can so queue step t+1 before it does
the host bookkeeping of step t (`EngineConfig.overlap_decode`), which needs three things here:

- **Carried tokens.** A row whose host token is ``-1`` takes its input token from the previous step's output on the
  device (that step's sample is not on the host yet).
- **Two pinned staging buffers, used in turn.** The caller's `host` buffer is copied into one (on the CPU, at once)
  and the device copies from there, so `host` can be refilled for step t+1 while step t's copy is still queued;
  step t+2 reuses step t's staging buffer only after step t was fetched, which is after its copy.
- **Outputs copied before the next launch.** A graph's output buffers are static: the next replay of the same graph
  overwrites them, so each launch queues its host copies (and the top-k of ``raw``) right behind its own step.

With CUDA graphs, a step runs at a bucketed batch (the smallest of ``batch_buckets`` covering the highest slot in
use; rows past the live ones are idle and write only to slots that no running sequence reads again: free ones, or,
overlapped, those of sequences that end at the step before) and a bucketed attention length (a power of two
>= the longest live position), so a handful of graphs serve all traffic. A graph is captured the first time its
(batch, length, with-LoRA, with-top-p, one LoRA slot) combination is needed (the slot: that of every row of a step
whose rows all read one adapter, which then skips the row masks, `lora_slots` "One slot"; None for the masked path),
from the real inputs of that step: the warm-up and capture runs repeat the very same computation, so their cache
writes are idempotent. A merged step (every row on one adapter, merged into a copy of the base weights:
`merged_weights`) runs the no-LoRA forward on that copy; its graphs are keyed apart from the others and serve every
slot, the copy being rebuilt in place when the slot or its adapter changes. Eagerly (the CPU), a step uses
the exact batch and length.
"""

from __future__ import annotations

import functools

import torch

from collections.abc import Callable
from dataclasses import dataclass

from backends.inference.decoder import DecoderRunner
from backends.inference.sampling import sample

ROWS = ("token", "pos", "lora", "temperature", "top_p", "uniform")


def default_batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_batch (and max_batch itself)."""
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_batch + 1, 16)] if b < max_batch} | {max_batch})


@dataclass
class Launched:
    """A decode step queued on the device. `out` [2, batch] (token, raw logprob) stays on the device (the next step
    may read its tokens there); `host_out` and `tops` are host copies, complete once `wait` returns."""

    out: torch.Tensor
    raw: torch.Tensor  # [batch, V] raw logprobs on the device; a graph's buffer: valid until the next launch
    host_out: torch.Tensor
    tops: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [len(top_rows), k], or None
    wait: Callable[[], None] | None = None

    def fetch(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Wait for the step; (out [2, batch] on the CPU, (top values, top ids) on the CPU or None)."""
        if self.wait is not None:
            self.wait()
        return self.host_out, self.tops


def copy_back(out: torch.Tensor, raw: torch.Tensor, top_rows: list[int], top_k: int,
              wait: Callable[[], None] | None = None) -> Launched:
    """Queue the host copies of a step's `out` and of the top-`top_k` logprobs of rows `top_rows` of `raw`; on CUDA
    into pinned memory behind the step, with an event to wait for."""
    cuda = out.device.type == "cuda"
    tops = None
    if top_rows:  # the row index from pinned memory: a pageable copy could wait for the steps queued before it
        rows = torch.tensor(top_rows, dtype=torch.long, pin_memory=cuda).to(raw.device, non_blocking=True)
        tops = tuple(raw[rows].topk(top_k, dim=-1))
    if not cuda:
        return Launched(out, raw, out, tops, wait)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in (out, *(tops or ()))]
    done = torch.cuda.Event()
    done.record()
    return Launched(out, raw, host[0], (host[1], host[2]) if tops else None, done.synchronize)


class DecodeStep:
    """Runs decode steps on `runner`; `graphs` turns CUDA graph capture on."""

    def __init__(self, runner: DecoderRunner, max_batch: int, max_len: int, graphs: bool):
        self.runner, self.max_batch, self.max_len = runner, max_batch, max_len
        self.graphs = graphs
        device = runner.device
        # fill it, then launch; pinned as well, for the benchmarks that copy it to `dev` themselves around a replay
        self.host = torch.zeros((len(ROWS), max_batch), dtype=torch.float64, pin_memory=device.type == "cuda")
        self._staging = [torch.zeros(self.host.shape, dtype=torch.float64, pin_memory=True)
                         for _ in range(2 if device.type == "cuda" else 0)]
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

    def _body(self, batch: int, length: int, lora: bool, top_p: bool, single_slot: int | None = None,
              lora_slots: int | None = None, merged: bool = False):
        d = self.dev[:, :batch]
        tokens, pos = d[0].long(), d[1].long()
        lora_rows = d[2].long() if lora and single_slot is None else None
        logits = self.runner.decode(tokens, pos, length, lora_rows, lora_slots, single_slot, merged)
        toks, lps, raw = sample(logits, d[3].float(), d[5], d[4].float() if top_p else None)
        return torch.stack((toks.double(), lps.double())), raw

    def launch(self, batch: int, length: int, lora: bool, top_p: bool, lora_slots: int | None = None,
               carry: torch.Tensor | None = None, top_rows: list[int] = (), top_k: int = 0,
               single_slot: int | None = None, merged: bool = False) -> Launched:
        """Queue a step of rows 0..batch-1 from `self.host` (already filled). Rows whose token is -1 take it from
        `carry` (the previous launch's `out`) on the device. Eagerly, LoRA columns are read only for slots <
        `lora_slots`; a graph always covers every slot. With `single_slot` (and `lora`), every row of the step
        gets that slot's LoRA term whatever its row in `host` says (`lora_slots` "One slot"); with `merged` too, it
        runs on the runner's merged weights instead, rebuilt for that slot first if they hold anything else (the
        caller makes sure no step reading them is still on the device)."""
        single_slot = single_slot if lora else None
        merged = merged and single_slot is not None
        if self._staging:
            self._staging.reverse()
            self.dev.copy_(self._staging[0].copy_(self.host), non_blocking=True)
        else:
            self.dev.copy_(self.host)
        if carry is not None:
            n = min(batch, carry.shape[1])
            tok = self.dev[0, :n]
            tok.copy_(torch.where(tok < 0, carry[0, :n], tok))
        if self.runner.lora.generation != self._generation:
            # LoRA stacks were reallocated: old graphs are stale, compiled layer functions need these stacks' variant
            self.clear()
            self._generation = self.runner.lora.generation
            self.runner.warm_up()
        if merged:
            self.runner.merged.hold(single_slot)
            lora, single_slot = False, None  # the no-LoRA forward, on the merged weights
        if not self.graphs:
            out, raw = self._body(batch, length, lora, top_p, single_slot, lora_slots, merged)
            return copy_back(out, raw, list(top_rows), top_k)
        key = (batch, length, lora, top_p, single_slot, merged)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key)
        graph, out, raw = entry
        graph.replay()
        return copy_back(out, raw, list(top_rows), top_k)

    def run(self, batch: int, length: int, lora: bool, top_p: bool, lora_slots: int | None = None,
            single_slot: int | None = None, merged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`launch` and wait: ([2, batch] on the CPU, raw [batch, V] on the device)."""
        launched = self.launch(batch, length, lora, top_p, lora_slots, single_slot=single_slot, merged=merged)
        return launched.fetch()[0], launched.raw

    def _capture(self, key: tuple) -> tuple:
        batch, length, lora, top_p, single_slot, merged = key
        body = functools.partial(self._body, batch, length, lora, top_p, single_slot, merged=merged)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer may run CUDA work on another thread meanwhile (the async pipeline trains while
        # later steps' rollouts decode); the default ("global") makes any such call invalidate this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out, raw = body()
        self._graphs[key] = (graph, out, raw)
        self.captures += 1
        return self._graphs[key]

    def clear(self) -> None:
        """Drop every graph and their memory pool: a pool whose graphs are all freed cannot take new captures
        (PyTorch asserts ``use_count > 0`` in capture_begin), so the next capture starts a fresh pool."""
        self._graphs.clear()
        self._pool = None
