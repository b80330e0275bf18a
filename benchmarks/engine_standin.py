"""An engine stand-in for measuring the embedded server's own CPU cost: the real `Engine` with its model computation
replaced by a GPU-like duration of waiting. Benchmarks only; the product never imports it.

What stays real: the engine's thread, scheduler, admission, per-token bookkeeping, finishing rules, KV-slot and
LoRA-slot accounting, detokenization and callbacks (everything `backends/inference/engine.py` does on the host).
What is replaced: `DecoderRunner.prefill` and `DecodeStep.launch`, the two calls that would run the model, both on
one modelled device stream (`StandInDevice`): work queued on it starts when the work before it ends.

- decode step of a batch of B rows: ``decode_ms(B) = decode_base_ms + decode_per_row_ms * B``. As on CUDA, `launch`
  returns at once and the output's host read (`Launched.fetch`) sleeps until the step's modelled end, with the GIL
  released as it is while the engine thread waits for a CUDA graph's output; a step launched while the previous one
  still "runs" starts when that one ends, so the engine's host work between launch and fetch overlaps the step
  (`EngineConfig.overlap_decode`) or, serially, adds to it. The default fits the H200's measured CUDA-graph replay
  of Qwen2.5-0.5B + rank-16 LoRA (2.52 ms at batch 1, 4.69 ms at batch 256: `benchmarks/results/engine-decode-h200.md`).
- prefill of P padded prompt tokens: ``prefill_ms(P) = prefill_base_ms + prefill_per_token_ms * P``, waited for at
  once, as the engine reads the first tokens right away (default 2 ms + 3 us per token: a guess of the order of the
  H200's prefill; the measured loads are decode-bound).
- tokens: each row's next token is a pure function of the row's uniform draw (the engine's seeded stream), spread
  over the tokenizer's ordinary ids, so detokenization does real work; its logprob is ``-8 * u``. ``top_logprobs``
  are drawn from a fixed [batch, 64] table.

The stand-in keeps counters of its own so a report can say how full the batch was and what the model computation
alone would have allowed: steps, rows stepped, modelled device seconds of decode and prefill (``*_device_s``: the
time the device would be busy), and the seconds the engine thread actually blocked reading decode outputs
(``decode_wait_s``; equal to the device seconds when nothing overlaps, less by the host work hidden behind steps).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import torch

TOP_WIDTH = 64


@dataclass
class StandInTiming:
    """Model-time assumptions of the stand-in (milliseconds)."""

    decode_base_ms: float = 2.5
    decode_per_row_ms: float = 0.0085
    prefill_base_ms: float = 2.0
    prefill_per_token_ms: float = 0.003

    def decode_ms(self, rows: int) -> float:
        return self.decode_base_ms + self.decode_per_row_ms * rows

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_per_token_ms * tokens

    def ceiling_tok_s(self, rows: int) -> float:
        """Tokens per second of back-to-back decode steps of `rows` rows, with no host work at all."""
        return rows * 1000.0 / self.decode_ms(rows)


class StandInCounters:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.decode_steps = self.decode_rows = self.prefills = self.prefill_tokens = 0
        self.decode_device_s = self.prefill_device_s = self.decode_wait_s = 0.0

    def add(self, kind: str, units: int, seconds: float) -> None:
        """Count one `kind` call ("decode": units are rows; "prefill": padded tokens) of `seconds` device time."""
        with self.lock:
            if kind == "decode":
                self.decode_steps, self.decode_rows = self.decode_steps + 1, self.decode_rows + units
                self.decode_device_s += seconds
            else:
                self.prefills, self.prefill_tokens = self.prefills + 1, self.prefill_tokens + units
                self.prefill_device_s += seconds

    def waited(self, seconds: float) -> None:
        """The engine thread blocked `seconds` reading a decode step's output."""
        with self.lock:
            self.decode_wait_s += seconds

    def snapshot(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "lock"}


class StandInDevice:
    """One modelled device stream: `enqueue` queues work behind what is queued and says when it will end; `wait`
    sleeps (GIL released) until then."""

    def __init__(self):
        self.busy_until = 0.0

    def enqueue(self, seconds: float) -> float:
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds
        return self.busy_until

    @staticmethod
    def wait(until: float) -> float:
        """Sleep until `until` (perf_counter time); returns the seconds slept."""
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return max(delay, 0.0)


class StandInRunner:
    """`DecoderRunner.prefill` without a model: waits its modelled time on `device`, returns flat logits (sampling
    then spreads the first token over `first_token_width` ids)."""

    merged = None  # no merged-adapter weights (`EngineConfig.merged_single_adapter`): the LoRA step's timing

    def __init__(self, timing: StandInTiming, counters: StandInCounters, first_token_width: int,
                 device: StandInDevice):
        self.timing, self.counters, self.width, self.device = timing, counters, first_token_width, device

    def warm_up(self) -> float:
        return 0.0

    def prefill(self, tokens, lengths, slots, lora_rows, lora_slots, single_slot=None, merged=False):
        padded = tokens.shape[0] * tokens.shape[1]
        seconds = self.timing.prefill_ms(padded) / 1000
        self.device.wait(self.device.enqueue(seconds))
        self.counters.add("prefill", padded, seconds)
        return torch.zeros((tokens.shape[0], self.width), dtype=torch.float32)


class StandInDecodeStep:
    """`DecodeStep` without a model: the same host buffer and bucket rule (eager: exact batch), each step queued on
    `device` for its modelled time."""

    graphs = False

    def __init__(self, max_batch: int, timing: StandInTiming, counters: StandInCounters, token_range: range,
                 device: StandInDevice):
        from backends.inference.cuda_graphs import ROWS

        self.host = torch.zeros((len(ROWS), max_batch), dtype=torch.float64)
        self.timing, self.counters, self.tokens, self.device = timing, counters, token_range, device
        self.captures = 0
        self._top = torch.log_softmax(torch.linspace(0, 4, TOP_WIDTH), dim=0).repeat(max_batch, 1)

    def bucket(self, rows: int, length: int) -> tuple[int, int]:
        return rows, length

    def launch(self, batch: int, length: int, lora: bool, top_p: bool, lora_slots: int | None = None,
               carry=None, top_rows: list[int] = (), top_k: int = 0, single_slot: int | None = None,
               merged: bool = False):
        """Returns at once; the `Launched`'s fetch waits for the step's modelled end. The tokens come from the
        uniform draws, which the host knows; `carry` (tokens on the device) is therefore not needed, nor are
        `single_slot` and `merged` (the modelled step takes as long either way)."""
        from backends.inference.cuda_graphs import copy_back

        u = self.host[5, :batch]
        lo, span = self.tokens.start, len(self.tokens)
        out = torch.stack(((u * span).floor() + lo, -8.0 * u))
        seconds = self.timing.decode_ms(batch) / 1000
        end = self.device.enqueue(seconds)
        self.counters.add("decode", batch, seconds)
        return copy_back(out, self._top[:batch], list(top_rows), top_k,
                         wait=lambda: self.counters.waited(self.device.wait(end)))


def install(engine, timing: StandInTiming) -> StandInCounters:
    """Replace `engine`'s model computation by the stand-in (before it serves any request); returns its counters."""
    counters = StandInCounters()
    special = set(engine.tokenizer.all_special_ids)
    first = max(special) + 1 if special else 0
    ordinary = range(first, min(engine.vocab, len(engine.tokenizer)))
    device = StandInDevice()
    engine.runner = StandInRunner(timing, counters, min(1024, engine.vocab), device)
    engine.step = StandInDecodeStep(engine.max_batch, timing, counters, ordinary, device)
    engine.standin = {"timing": asdict(timing), "counters": counters, "token_ids": [ordinary.start, ordinary.stop]}
    return counters
