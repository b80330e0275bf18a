"""The embedded inference engine: continuous batching over a slot KV cache, LoRA per row, seeded sampling.

Why our own scheduler and forward rather than transformers' continuous batching (``generate_batch`` /
``ContinuousBatchingManager``): its sampling parameters are one ``GenerationConfig`` for the whole manager (no
per-request temperature/top_p/seed), it samples from the global RNG, the logprob it can return is of the *processed*
distribution (after temperature/top-p) rather than the raw one GRPO needs, and it has no adapter per request. It is
also slow where it counts: on an H200 with a 0.5B Qwen2.5 shape ``generate_batch`` gave 680 tok/s at concurrency 64,
and plain ``generate`` 16 tok/s at concurrency 1 (a 62 ms decode step, almost all host overhead, against a ~0.2 ms
bandwidth limit); a batching scheduler over ``generate`` would keep that overhead and wait for the slowest sequence
of each batch. This engine, on the same shape serving an unmerged LoRA r16
(``benchmarks/results/inference-h200-qwen05-lora16.md``): 334 tok/s at concurrency 1 and 13,000 tok/s at 64 (20,000
without the adapter), against 13 tok/s for one ``generate`` per request in the same run; on this 2-core CPU with
SmolLM2-135M, 67 tok/s at 64 against 15. How:

- **Continuous batching.** Every running sequence owns a KV slot (`kv_cache`). A loop iteration admits waiting
  requests into free slots (one padded prefill for all of them, bounded by a token budget), then runs one decode
  step over all running sequences; a sequence that finishes frees its slot at once, so nobody waits for the slowest
  sequence. While others decode, newcomers wait up to ``admission_wait_steps`` steps so that requests arriving a few
  at a time share one prefill (`_admission_due`). The prompts of one text completion are handed over at once
  (`submit_all`): they are admitted together when the free slots and the prefill budget allow, whatever the timing
  of the engine thread.
- **Forward** (`decoder`): Llama/Qwen2/Qwen3/Mistral maths over the HF model's own weights; per-row LoRA from
  up to ``max_loras`` resident adapters in one batch (`lora_slots`); a decode step whose rows all use one adapter
  reads that slot alone, without row masks (``single_slot_lora``), or runs on a copy of the weights with that
  adapter merged in (``merged_single_adapter``, `merged_weights`).
- **Step** (`cuda_graphs`): on CUDA, forward + sampling of a decode step replay from a CUDA graph (static KV cache,
  bucketed batch and length); on the CPU the same code runs eagerly.
- **Overlap** (``overlap_decode``): the host work of a decode step (reading its tokens, appending them, stop checks,
  callbacks) runs while the device computes the next step, as vLLM's async scheduling does; see `_decode`.
- **Streams** (`stream`): a streamed request's tokens go to its event loop as each step accepts them, in the same
  one wake-up per step that hands over finished requests (`loop_handoff`); a request without a stream pays one
  attribute check per row and step. Only accepted tokens are streamed, so the discarded row of an overlapped step
  never reaches one.
- **Sampling** (`sampling`): raw logprobs; one counter-based uniform per token from the request's seed, so
  the same seed gives the same tokens whatever else is in the batch, except when float differences in logits
  between batch shapes move a draw across a token boundary (rare: the uniform has to fall within ~1e-6 of it).
- **Shared prefill** (`prompt_sharing`): requests with the same prompt and adapter (a GRPO group sent as n=1
  requests) share one prefill row, as the n choices of one request do: the row's KV prefix is copied to their slots
  and each samples its first token with its own seed. Requests admitted together share a row; a request admitted
  later reuses it without a forward while a sequence holding it still runs (its logits are kept that long).
- **Limits.** A prompt is prefilled in one go (no chunked prefill): a long prompt delays running sequences by one
  prefill. Only equal prompts share: a prompt that extends another one (a later turn) is prefilled from position 0,
  and so is a prompt whose earlier requests have all finished.

The benchmark (``benchmarks/inference.py``, results in ``benchmarks/results/``) measures this engine against one
``generate`` per request, on this CPU and on an H200.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import heapq
import logging
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.inference.adapters import AdapterEntry, AdapterRegistry, UnknownModel
from backends.inference.cuda_graphs import DecodeStep, Launched
from backends.inference.decoder import DecoderRunner, describe
from backends.inference.engine_config import EngineConfig
from backends.inference.kv_cache import SlotKVCache
from backends.inference.loop_handoff import LoopHandoff
from backends.inference.lora_slots import LoraSlots
from backends.inference.prompt_sharing import LivePrompts, share_rows
from backends.inference.sampling import choice_seed, sample, uniform
from backends.modeling.chat_render import end_of_turn_ids

log = logging.getLogger(__name__)
MAX_TOP_LOGPROBS = 20
# The engine thread waits for the device every step with the GIL released, then needs it back. Another thread that
# is running Python (the server building a response, a rollout's client) keeps it up to the interpreter's switch
# interval, 5 ms by default: longer than a decode step. An engine lowers the process's interval to this (never
# raises it): with the stand-in of benchmarks/serving_overhead.py at c=64, 0.5 ms gave 10.6-11.9k tok/s over HTTP
# against 7.7-9.8k at 5 ms, and the engine's host time per step fell from 1.0-1.6 ms to 0.7-0.8 ms.
SWITCH_INTERVAL_S = 0.0005


@dataclass
class SamplingParams:
    """Per-request sampling. `max_tokens` None means up to the context; a temperature below
    `sampling.SAMPLING_EPS` (0 included) means greedy."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0


@dataclass
class Completion:
    """One finished choice: sampled ids with their raw logprobs, text (cut before a stop string), why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    text: str
    stop_reason: str | int | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """One token a step accepted for choice `choice` of a streamed request, with its raw logprob and, if asked,
    its top logprobs."""

    choice: int
    token: int
    logprob: float
    top: list[tuple[int, float]] | None


class RequestError(ValueError):
    """The request is invalid for this engine (too long, bad parameters); maps to HTTP 400."""


class EngineStopped(RuntimeError):
    """The engine shut down before the request finished."""


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    n: int
    max_tokens: int
    seed: int
    adapter: AdapterEntry | None
    on_done: object
    on_tokens: object = None  # streamed requests: called once per step with that step's accepted tokens
    lora_slot: int = -1
    seqs: list["_Seq"] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    arrived_step: int = 0  # the engine's decode-step count when it was taken from the inbox (`_admission_due`)


@dataclass
class _Seq:
    req: _Request
    choice: int
    slot: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list | None = None
    pos: int = 0
    finish: str | None = None
    stop_reason: str | int | None = None
    cut: int | None = None
    launched: int = -1  # number of the last decode step this sequence had a row in


@dataclass
class _Step:
    """A launched decode step whose tokens the host has not accepted yet."""

    number: int
    seqs: list[_Seq]  # one row each, at its slot
    launched: Launched
    top_rows: list[int]  # indices into `seqs` whose top logprobs were asked for
    merged: bool = False  # it reads the merged weights (`merged_single_adapter`)


class Engine:
    """Serves `model` (a loaded HF causal LM, maybe peft-wrapped) and its LoRA adapters; `name` is the base name.

    Thread-safe: `submit`/`generate`/`load_adapter` may be called from any thread or event loop; one background
    thread owns the device.
    """

    def __init__(self, model, tokenizer, name: str, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model = model  # the weights it serves; held so that a trainer loaded later can share them
        info = describe(model)
        embed = model.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        cuda = self.device.type == "cuda"
        cap = 8192 if cuda else 4096
        self.max_seq_len = int(config.max_seq_len or min(info["context"], cap))
        if self.max_seq_len > info["context"]:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's context {info['context']}")
        self.max_batch = config.max_batch_size
        self.prefill_budget = config.prefill_token_budget or (16384 if cuda else 4096)
        self.admission_wait = (4 if cuda else 0) if config.admission_wait_steps is None else config.admission_wait_steps
        self.name, self.vocab = name, info["vocab"]
        self.tokenizer = tokenizer
        self._tok = copy.deepcopy(tokenizer)  # the engine thread's own copy: HF fast tokenizers are not re-entrant
        self.kv = SlotKVCache(info["num_layers"], self.max_batch, info["num_kv_heads"], self.max_seq_len,
                              info["head_dim"], self.dtype, self.device)
        self.lora = LoraSlots(info["layout"], info["num_layers"], config.max_loras, self.dtype, self.device)
        fuse = cuda if config.fuse_projections is None else config.fuse_projections
        self.runner = DecoderRunner(model, self.max_seq_len, self.kv, self.lora, fuse,
                                    fuse_lora_a=cuda if config.fuse_lora_a is None else config.fuse_lora_a,
                                    compile=bool(config.compile_decode), merged=config.merged_single_adapter)
        graphs = cuda if config.cuda_graphs is None else (config.cuda_graphs and cuda)
        self.step = DecodeStep(self.runner, self.max_batch, self.max_seq_len, graphs)
        self.overlap = graphs if config.overlap_decode is None else config.overlap_decode
        from backends.modeling.loading import cache_root

        cache_dir = Path(config.adapter_cache_dir) if config.adapter_cache_dir else cache_root()
        self.adapters = AdapterRegistry([name], info["layout"], info["num_layers"], config.max_lora_rank,
                                        cache_dir, config.max_cpu_loras, self.dtype)
        self.eos_ids = end_of_turn_ids(model, tokenizer)
        # decode_seconds: the engine thread's wall time in decode steps: filling, launching, waiting for and accepting
        # them. Serially that is each step's device time plus its host work; overlapped, the device time of a step
        # hides behind the previous step's host work, so decode_seconds / decode_steps is the loop's period per step.
        # single_slot_steps: decode steps that took the one-LoRA-slot path (`EngineConfig.single_slot_lora`);
        # merged_steps those that ran on merged weights (`merged_single_adapter`; merged_prefills: prefills that did,
        # their rows all on one adapter), merge_rebuilds and merge_seconds the rebuilds of those weights and their
        # host time (a decode step's included in decode_seconds).
        # prefill_tokens: prompt tokens computed (a row shared in one admission counts once, a live row not at all);
        # shared_prefill_requests: requests whose first token came from a row computed for another request (of their
        # admission, or one a running sequence holds).
        self.stats = {"requests": 0, "prefill_tokens": 0, "prefills": 0, "shared_prefill_requests": 0,
                      "decode_steps": 0, "single_slot_steps": 0, "merged_steps": 0, "merged_prefills": 0,
                      "merge_rebuilds": 0, "merge_seconds": 0.0, "generated_tokens": 0, "decode_seconds": 0.0,
                      "warm_up_seconds": 0.0}
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Seq] = {}
        self._free = list(range(self.max_batch))
        self._ids = 0
        self._steps = 0
        self._inflight: _Step | None = None  # overlapped: the step launched and not yet accepted
        self.live_prompts = LivePrompts()  # prefill rows that running sequences hold (`prompt_sharing`)
        self._stopping = False
        self._handoff = LoopHandoff()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str, device: str = "cpu", dtype=None, served_name: str | None = None,
                        config: EngineConfig | None = None) -> "Engine":
        """Load `model` ("tiny-random", "smollm2-135m" or a local folder) and serve it as `served_name` or its id."""
        from backends.modeling.loading import load_model

        hf_model, tok, spec = load_model(model, device=device, dtype=dtype, shared=True)  # a trainer here shares them
        return cls(hf_model, tok, served_name or spec.name, config)

    # -- public API -------------------------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterEntry:
        """Register adapter `name` from a local folder or storage URI (validated now; placed on the device on use)."""
        old = None
        if replace:
            old = next((e for e in self.adapters.entries() if e.name == name), None)
        entry = self.adapters.load(name, path, replace=replace)
        if old is not None and old.uid != entry.uid:
            self._post(("forget", old.uid))
        return entry

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (requests already running on it finish with it)."""
        entry = self.adapters.unload(name)
        self._post(("forget", entry.uid))

    def submit(self, prompt: list[int], params: SamplingParams, model: str | None = None, n: int = 1,
               on_done=None, on_tokens=None) -> int:
        """Queue a request; `on_done(list[Completion] | Exception)` is called from the engine thread, and with
        `on_tokens`, ``on_tokens(list[Accepted])`` once per engine step that accepted tokens of the request, before
        `on_done`."""
        return self.submit_all([prompt], params, model, n, [on_done], [on_tokens])[0]

    def submit_all(self, prompts: list[list[int]], params: SamplingParams, model: str | None = None, n: int = 1,
                   on_done: list | None = None, on_tokens: list | None = None) -> list[int]:
        """Queue one request per prompt (the prompts of one text completion), each with its callbacks as `submit`
        has them (``on_done[i]``, ``on_tokens[i]``); returns their ids.

        Every prompt is checked before any is queued, and they reach the engine thread in one hand-over: they wait
        and are admitted together (one prefill, then the same decode steps), unless free slots or the prefill budget
        run out among them. Queued one by one, the engine thread could admit the first before the next arrived, and
        how rows are batched moves the float32 rounding of their logprobs: the same request would then not give the
        same numbers twice on an idle engine."""
        adapter = self.adapters.resolve(model) if model else None
        max_tokens = [self._validate(prompt, params, n) for prompt in prompts]
        on_done = on_done or [None] * len(prompts)
        on_tokens = on_tokens or [None] * len(prompts)
        with self._cv:
            first = self._ids + 1
            self._ids += len(prompts)
        reqs = [_Request(first + i, list(prompt), params, n, most,
                         params.seed if params.seed is not None else secrets.randbits(63), adapter,
                         done or (lambda _: None), tokens)
                for i, (prompt, most, done, tokens) in enumerate(zip(prompts, max_tokens, on_done, on_tokens))]
        self._post(*reqs)
        return [req.id for req in reqs]

    async def generate(self, prompt: list[int], params: SamplingParams, model: str | None = None,
                       n: int = 1) -> list[Completion]:
        """Run a request from an event loop; cancelling the awaiting task aborts it."""
        return (await self.generate_all([prompt], params, model, n))[0]

    async def generate_all(self, prompts: list[list[int]], params: SamplingParams, model: str | None = None,
                           n: int = 1) -> list[list[Completion]]:
        """Run one request per prompt, submitted together (`submit_all`); -> each prompt's completions. A failure of
        one, or cancelling the awaiting task, aborts them all."""
        handed = [self._handoff.future() for _ in prompts]
        rids = self.submit_all(prompts, params, model, n, [done for _, done in handed])
        try:
            if len(handed) == 1:  # a chat's one prompt: gather would add ~7 us of the loop's time (CPU, 3.11)
                return [await handed[0][0]]
            return list(await asyncio.gather(*(fut for fut, _ in handed)))
        except BaseException:
            for rid, (fut, _) in zip(rids, handed):
                if fut.cancelled() or not fut.done():  # not answered by the engine: still runs there
                    self.abort(rid)
            raise

    async def stream(self, prompt: list[int], params: SamplingParams, model: str | None = None,
                     n: int = 1) -> AsyncIterator[list[Accepted] | list[Completion]]:
        """Run a request from an event loop, yielding its tokens as engine steps accept them: lists of `Accepted`
        (one step's, or several steps' when the reader is slower than the engine), then the request's completions
        (the same as `generate` returns). Closing the iterator early, or cancelling its reader, aborts the request.

        Tokens reach the loop through the same per-step hand-off as finished requests (`loop_handoff`): one wake-up
        of the loop per engine step, whatever the number of streamed rows."""
        async with contextlib.aclosing(self.stream_all([prompt], params, model, n)) as items:  # closed with this one
            async for _, item in items:
                yield item

    async def stream_all(self, prompts: list[list[int]], params: SamplingParams, model: str | None = None,
                         n: int = 1) -> AsyncIterator[tuple[int, list[Accepted] | list[Completion]]]:
        """`stream` of one request per prompt, submitted together (`submit_all`), read as one: yields (prompt index,
        item) in the order the engine handed them over, until every prompt's completions came. A prompt's error is
        raised; closing the iterator early, or cancelling its reader, aborts the requests not finished."""
        channel, put = self._handoff.channel()
        feeds = [lambda result, i=i: put((i, result)) for i in range(len(prompts))]
        rids = self.submit_all(prompts, params, model, n, feeds, feeds)
        unfinished = set(range(len(prompts)))
        try:
            while unfinished:
                for index, item in await channel.take():
                    if isinstance(item, BaseException) or (item and isinstance(item[0], Completion)):
                        unfinished.discard(index)  # the engine has let go of it
                    if isinstance(item, BaseException):
                        raise item
                    yield index, item
        finally:
            for i in unfinished:
                self.abort(rids[i])

    def generate_sync(self, prompt: list[int], params: SamplingParams, model: str | None = None,
                      n: int = 1, timeout: float | None = None) -> list[Completion]:
        """Blocking variant of `generate` for scripts and benchmarks."""
        box: list = []
        ready = threading.Event()

        def done(result):
            box.append(result)
            ready.set()

        rid = self.submit(prompt, params, model, n, done)
        if not ready.wait(timeout):
            self.abort(rid)
            raise TimeoutError(f"request {rid} did not finish in {timeout} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def abort(self, request_id: int) -> None:
        """Stop a request; its slots are freed at the next iteration and its callback is not called. Nothing to do
        once the engine is shut down: it runs nothing."""
        with contextlib.suppress(EngineStopped):
            self._post(("abort", request_id))

    def shutdown(self, timeout: float = 30) -> None:
        """Fail what is pending, stop the engine thread and free the KV cache."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.kv.close()

    def activity(self) -> dict[str, int]:
        """Requests queued for admission and sequences being decoded, as the engine thread last left them."""
        return {"waiting": len(self._waiting) + len(self._inbox), "running": len(self._running)}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # -- validation -------------------------------------------------------------------------------------------------
    def _validate(self, prompt: list[int], p: SamplingParams, n: int) -> int:
        if not prompt:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.vocab for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab})")
        if len(prompt) >= self.max_seq_len:
            raise RequestError(f"This model's maximum context length is {self.max_seq_len} tokens. However, your "
                               f"prompt is {len(prompt)} tokens, leaving no room for a completion.")
        room = self.max_seq_len - len(prompt)
        max_tokens = room if p.max_tokens is None else p.max_tokens
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        if max_tokens > room:
            raise RequestError(f"This model's maximum context length is {self.max_seq_len} tokens. However, you "
                               f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                               f"{max_tokens} in the completion). Reduce the length of the messages or completion.")
        if not 1 <= n <= self.max_batch:
            raise RequestError(f"n must be between 1 and {self.max_batch} (the engine's batch size), got {n}")
        if not (p.temperature == p.temperature and 0 <= p.temperature <= 100):
            raise RequestError(f"temperature must be in [0, 100], got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
        if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
        if any(not isinstance(s, str) or not s for s in p.stop) or len(p.stop) > 16:
            raise RequestError("stop must be up to 16 non-empty strings")
        bad = next((t for t in p.stop_token_ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab})")
        return max_tokens

    # -- engine thread ----------------------------------------------------------------------------------------------
    def _post(self, *items) -> None:
        """Hand `items` to the engine thread at once: it takes them in the same iteration."""
        with self._cv:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            self._inbox.extend(items)
            self._cv.notify()

    def _loop(self) -> None:
        if self.device.type == "cuda":  # streams and graph captures go to this thread's current device: ours
            torch.cuda.set_device(self.device)
        with torch.inference_mode():
            # compiles before the first request is taken (requests submitted meanwhile wait in the inbox)
            try:
                self.stats["warm_up_seconds"] = self.runner.warm_up()
            except Exception:  # noqa: BLE001 - steps compile on first use instead; the engine still serves
                log.exception("decode warm-up failed")
            while True:
                with self._cv:
                    while not (self._inbox or self._waiting or self._running or self._stopping):
                        self._cv.wait()
                    items = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                if stopping:
                    self._fail_all(EngineStopped("the engine shut down"), items)
                    self._handoff.wake()
                    return
                admitted: list[_Request] = []
                controls = self._take_requests(items)
                try:
                    if self._inflight is not None and (controls or self._admission_due()):
                        self._drain()  # aborts, forgotten adapters and admission see no step in flight
                except Exception as e:  # noqa: BLE001 - as below
                    log.exception("engine step failed")
                    self._fail_running(e)
                self._take(controls)
                try:
                    admitted = self._admit() if self._inflight is None and self._admission_due() else []
                    if admitted:
                        self._prefill(admitted)
                    if self._running:
                        self._decode()
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the engine
                    log.exception("engine step failed")
                    self._fail_running(e)
                self._handoff.wake()  # what finished in this iteration reaches each event loop in one wake-up
                if not admitted and not self._running and self._waiting:
                    with self._cv:  # waiting requests that cannot be admitted yet: do not spin
                        self._cv.wait(0.01)

    def _take_requests(self, items: list) -> list:
        """Queue the new requests of `items` (safe with a step in flight); return the rest (aborts, forgets)."""
        controls = []
        for item in items:
            if isinstance(item, _Request):
                self.stats["requests"] += 1
                item.arrived_step = self._steps
                self._waiting.append(item)
            else:
                controls.append(item)
        return controls

    def _take(self, controls: list) -> None:
        for item in controls:
            if item[0] == "abort":
                self._abort(item[1])
            elif item[0] == "forget":
                self.lora.forget(item[1])

    def _abort(self, rid: int) -> None:
        for req in list(self._waiting):
            if req.id == rid:
                self._waiting.remove(req)
        for seq in list(self._running.values()):
            if seq.req.id == rid:
                seq.req.cancelled = True
                self._release_seq(seq)

    def _admissible(self) -> bool:
        """A waiting request may fit now (enough free KV slots; its adapter's slot is only known by trying)."""
        return bool(self._waiting) and len(self._free) >= self._waiting[0].n

    def _admission_due(self) -> bool:
        """Admit now: a waiting request may fit, and nothing is decoding, or the oldest waiting request has waited
        ``admission_wait_steps`` decode steps, or the waiting ones would fill the free slots or the prefill budget
        (waiting longer could not make the prefill bigger)."""
        if not self._admissible():
            return False
        if not self._running or self._steps - self._waiting[0].arrived_step >= self.admission_wait:
            return True
        rows = sum(r.n for r in self._waiting)
        tokens = len(self._waiting) * max(len(r.prompt) for r in self._waiting)
        return rows >= len(self._free) or tokens >= self.prefill_budget

    def _admit(self) -> list[_Request]:
        admitted: list[_Request] = []
        longest = 0
        while self._waiting:
            req = self._waiting[0]
            if len(self._free) < req.n:
                break
            longest_if = max(longest, len(req.prompt))
            if admitted and (len(admitted) + 1) * longest_if > self.prefill_budget:
                break
            if req.adapter is not None:
                if not self.adapters.is_live(req.adapter.uid):
                    self._waiting.popleft()
                    self._notify(req, UnknownModel(req.adapter.name, self.adapters.names()))
                    continue
                try:
                    slot = self.lora.acquire(req.adapter.uid, lambda e=req.adapter: self.adapters.host_weights(e))
                except Exception as e:  # noqa: BLE001 - the adapter's files vanished or broke since it was loaded
                    self._waiting.popleft()
                    self._notify(req, e)
                    continue
                if slot is None:
                    break
                req.lora_slot = slot
            self._waiting.popleft()
            slots = [heapq.heappop(self._free) for _ in range(req.n)]
            req.seqs = [_Seq(req, c, s, choice_seed(req.seed, c), pos=len(req.prompt) - 1)
                        for c, s in enumerate(slots)]
            req.remaining = req.n
            for seq in req.seqs:
                self._running[seq.slot] = seq
            admitted.append(req)
            longest = longest_if
        return admitted

    def _prefill_rows(self, heads: list[_Request]) -> torch.Tensor:
        """One padded prefill of the prompts of `heads`, each into its first choice's slot -> logits [rows, V]."""
        longest = max(len(r.prompt) for r in heads)
        tokens = torch.zeros((len(heads), longest), dtype=torch.long)
        for i, r in enumerate(heads):
            tokens[i, : len(r.prompt)] = torch.tensor(r.prompt)
        dev = self.device
        lengths = torch.tensor([len(r.prompt) for r in heads], device=dev)
        slots = torch.tensor([r.seqs[0].slot for r in heads], device=dev)
        lora_rows = lora_slots = None
        if any(r.lora_slot >= 0 for r in heads):
            lora_rows = torch.tensor([r.lora_slot for r in heads], device=dev)
            lora_slots = max(r.lora_slot for r in heads) + 1
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(len(r.prompt) for r in heads)
        # rows all on one adapter take a decode step's path: that slot alone, or the merged weights, made to hold it
        # here (the rebuild the next merged decode step would make; admission drained any step in flight). Always the
        # same path for the same rows, so a request's numbers do not depend on what ran before it
        single, merged = self._lora_path(self._one_slot([r.seqs[0] for r in heads]))
        if merged:
            self.runner.merged.hold(single)
            self._note_merges()
        self.stats["merged_prefills"] += merged
        return self.runner.prefill(tokens.to(dev), lengths, slots, lora_rows, lora_slots, single, merged)

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill the admitted requests with one row per distinct (adapter, prompt) (`prompt_sharing`): rows that a
        running sequence holds are not computed again, the others in one padded batch. Every slot of a row gets a
        copy of its KV prefix, and every sequence samples its first token from its row's logits with its own seed,
        temperature and top-p."""
        shared = share_rows([r.prompt for r in reqs], [r.lora_slot for r in reqs])
        heads = [reqs[i] for i in shared.firsts]
        live = [None if key is None else self.live_prompts.find(key) for key in shared.keys]
        fresh = [k for k, hit in enumerate(live) if hit is None]
        row_logits = [hit[0] if hit is not None else None for hit in live]
        if fresh:
            computed = self._prefill_rows([heads[k] for k in fresh])
            for j, k in enumerate(fresh):
                row_logits[k] = computed[j].clone()  # kept while the row is live: not a view of the whole batch
        group_seqs: list[list[_Seq]] = [[] for _ in heads]
        for r, row in zip(reqs, shared.rows):
            group_seqs[row] += r.seqs
        for r, group, hit, key, logits in zip(heads, group_seqs, live, shared.keys, row_logits):
            source = group[0] if hit is None else hit[1]  # a fresh row was prefilled into its first slot
            self.kv.copy_prefix(source.slot, [s.slot for s in group if s is not source], len(r.prompt))
            if key is not None:
                self.live_prompts.hold(key, logits, group)
        self.stats["shared_prefill_requests"] += len(reqs) - len(fresh)
        dev = self.device
        logits = torch.stack(row_logits)
        seqs = [s for r in reqs for s in r.seqs]
        rows = torch.tensor([row for r, row in zip(reqs, shared.rows) for _ in r.seqs], device=dev)
        temp = torch.tensor([s.req.params.temperature for s in seqs], device=dev, dtype=torch.float32)
        top_p = [s.req.params.top_p for s in seqs]
        u = torch.tensor([uniform(s.seed, 0) for s in seqs], device=dev, dtype=torch.float64)
        top_p_t = torch.tensor(top_p, device=dev, dtype=torch.float32) if min(top_p) < 1 else None
        toks, lps, raw = sample(logits[rows], temp, u, top_p_t)
        want = [i for i, s in enumerate(seqs) if s.req.params.top_logprobs > 0]
        tops = None
        if want:
            vals, ids = raw[torch.tensor(want, device=dev)].topk(max(seqs[i].req.params.top_logprobs for i in want))
            tops = (vals.cpu(), ids.cpu())
        self._accept(seqs, toks.tolist(), lps.tolist(), self._tops(seqs, want, tops), None)

    def _decode(self) -> None:
        """One decode step over the running sequences.

        Serially: fill the inputs, launch step t, wait for it, accept its tokens. Overlapped (``overlap_decode``):
        launch step t+1, then accept step t, which ran meanwhile. Step t+1 is built before step t's tokens are on
        the host, so for every row of step t:

        - its input token is step t's sample, copied on the device (host token -1, `DecodeStep.launch`);
        - position ``pos + 1`` and the uniform ``uniform(seed, len(tokens) + 1)``: both known ahead;
        - a sequence that step t finishes is known only after step t+1 is launched: its row in step t+1 is
          computed and discarded (`_accept_step`), and its KV slot and LoRA slot are freed after that step (an
          admission, which could reuse them, first drains the step in flight). Finishing on length is known ahead:
          those sequences get no extra row.

        The completions are those of the serial loop (seeded draws are indexed by token, sampling does not depend on
        other rows' top-p). Where an extra row changes a step's shape (on CUDA: its batch bucket, or whether the
        LoRA or top-p graph runs) the other rows' logits may round differently, as with any change of batch
        composition; on the CPU the eager step gives the same numbers for the tests' batches.
        """
        t0 = time.perf_counter()
        prev = self._inflight
        lag = 1 if prev is not None else 0  # every live sequence had a row in `prev`: no prefill while in flight
        seqs = [s for s in self._running.values() if s.finish is None
                and not (lag and (len(s.tokens) + 1 >= s.req.max_tokens or s.pos + 2 >= self.max_seq_len))]
        one = self._one_slot(seqs)
        if prev is not None and prev.merged and one is not None and not self.runner.merged.holds(one):
            # the rebuild would overwrite weights that the step in flight reads. A safeguard: a merged step's rows
            # are all on one slot and the next step's rows are some of them (an admission drains first)
            self._drain()
            self._decode()
            return
        step = self._launch(seqs, lag, prev, one) if seqs else None
        self._inflight = step if self.overlap else None
        if prev is not None:
            self._accept_step(prev, step)
        if step is not None and not self.overlap:
            self._accept_step(step, None)
        self.stats["decode_seconds"] += time.perf_counter() - t0

    def _launch(self, seqs: list[_Seq], lag: int, prev: _Step | None, one: int | None) -> _Step:
        """Launch a decode step over `seqs`; `one`: the LoRA slot of all of them (`_one_slot`)."""
        rows = max(s.slot for s in seqs) + 1
        length = max(s.pos for s in seqs) + lag + 1
        batch, span = self.step.bucket(rows, length)
        host = self.step.host.numpy()
        host[:, :batch] = ((0,), (0,), (-1,), (1,), (1,), (0,))
        slots = [s.slot for s in seqs]
        host[0, slots] = [-1 if lag else s.tokens[-1] for s in seqs]
        host[1, slots] = [s.pos + lag for s in seqs]
        host[2, slots] = [s.req.lora_slot for s in seqs]
        host[3, slots] = [s.req.params.temperature for s in seqs]
        host[4, slots] = [s.req.params.top_p for s in seqs]
        host[5, slots] = [uniform(s.seed, len(s.tokens) + lag) for s in seqs]
        lora_max = max(s.req.lora_slot for s in seqs)
        # One slot: every row the step computes for a sequence (a discarded extra row included) reads it. Rows of no
        # sequence (idle bucket rows, a slot between live ones) then get that slot's delta too: never read.
        single, merged = self._lora_path(one)
        self.stats["single_slot_steps"] += single is not None and not merged
        self.stats["merged_steps"] += merged
        use_top_p = any(s.req.params.top_p < 1 for s in seqs)
        want = [i for i, s in enumerate(seqs) if s.req.params.top_logprobs > 0]
        k = max((seqs[i].req.params.top_logprobs for i in want), default=0)
        launched = self.step.launch(batch, span, lora_max >= 0, use_top_p, lora_slots=lora_max + 1,
                                    carry=prev.launched.out if lag else None, top_rows=[slots[i] for i in want],
                                    top_k=k, single_slot=single, merged=merged)
        if merged:
            self._note_merges()
        self._steps += 1
        for s in seqs:
            s.launched = self._steps
        self.stats["decode_steps"] += 1
        return _Step(self._steps, seqs, launched, want, merged)

    def _lora_path(self, one: int | None) -> tuple[int | None, bool]:
        """(the LoRA slot a pass reads alone, or None; whether it runs on the merged weights) for rows all on slot
        `one` (`_one_slot`; None: mixed or base rows)."""
        merged = one is not None and self.runner.merged is not None
        return (one if merged or self.config.single_slot_lora else None), merged

    def _note_merges(self) -> None:
        self.stats["merge_rebuilds"] = self.runner.merged.rebuilds
        self.stats["merge_seconds"] = self.runner.merged.seconds

    @staticmethod
    def _one_slot(seqs: list[_Seq]) -> int | None:
        """The LoRA slot of every sequence in `seqs`, or None (several slots, base rows, no sequences)."""
        slots = {s.req.lora_slot for s in seqs}
        return next(iter(slots)) if len(slots) == 1 and min(slots) >= 0 else None

    def _accept_step(self, step: _Step, following: _Step | None) -> None:
        """Accept `step`'s tokens; `following` is the step already launched after it (overlapped), or None."""
        out, top = step.launched.fetch()
        tops = self._tops(step.seqs, step.top_rows, top)
        live = [i for i, s in enumerate(step.seqs) if s.finish is None]
        for s in step.seqs:
            if s.finish is not None:  # finished at the step before: this row was computed only to be dropped
                self._release_seq(s)
        slots = [step.seqs[i].slot for i in live]
        self._accept([step.seqs[i] for i in live], out[0, slots].long().tolist(), out[1, slots].tolist(),
                     {j: tops[i] for j, i in enumerate(live) if i in tops}, following)

    def _drain(self) -> None:
        """Accept the step in flight (overlapped) and free what it finished: the state the serial loop leaves."""
        t0 = time.perf_counter()
        step, self._inflight = self._inflight, None
        self._accept_step(step, None)
        self.stats["decode_seconds"] += time.perf_counter() - t0

    @staticmethod
    def _tops(seqs: list[_Seq], want: list[int], tops) -> dict[int, list[tuple[int, float]]]:
        """{index into seqs: [(token, raw logprob)] * its top_logprobs} from the top-k rows of `want` (in order)."""
        if not want:
            return {}
        vals, ids = tops[0].tolist(), tops[1].tolist()
        return {i: list(zip(ids[j][: seqs[i].req.params.top_logprobs], vals[j][: seqs[i].req.params.top_logprobs]))
                for j, i in enumerate(want)}

    def _accept(self, seqs: list[_Seq], toks: list[int], lps: list[float], tops: dict[int, list[tuple[int, float]]],
                following: _Step | None) -> None:
        self.stats["generated_tokens"] += len(seqs)
        streamed: dict[int, list[Accepted]] = {}
        finished: list[_Seq] = []
        for i, (s, t, lp) in enumerate(zip(seqs, toks, lps)):
            s.tokens.append(t)
            s.logprobs.append(lp)
            top = tops.get(i)
            if top is not None:
                s.tops = (s.tops or []) + [top]
            s.pos += 1
            if s.req.on_tokens is not None:
                streamed.setdefault(s.req.id, []).append(Accepted(s.choice, t, lp, top))
            self._check_finished(s, t)
            if s.finish is not None:
                finished.append(s)
        if streamed:  # a stream gets a step's tokens before its request's completions
            for s in seqs:
                rows = streamed.pop(s.req.id, None)
                if rows is not None and not s.req.cancelled:
                    self._notify(s.req, rows, s.req.on_tokens)
        for s in finished:
            self._complete_seq(s)
            if following is None or s.launched != following.number:
                self._release_seq(s)  # else its row in `following` still runs: freed when that is accepted

    def _check_finished(self, s: _Seq, token: int) -> None:
        p = s.req.params
        if token in self.eos_ids and not p.ignore_eos:
            s.finish = "stop"
        elif token in p.stop_token_ids:
            s.finish, s.stop_reason = "stop", token
        elif p.stop:
            text = self._tok.decode(s.tokens, skip_special_tokens=True)
            hits = [(text.find(x), x) for x in p.stop if x in text]
            if hits:
                s.cut, s.stop_reason = min(hits)
                s.finish = "stop"
        if s.finish is None and (len(s.tokens) >= s.req.max_tokens or s.pos + 1 >= self.max_seq_len):
            s.finish = "length"

    def _complete_seq(self, s: _Seq) -> None:
        """`s` has finished: its request is answered once all its choices have."""
        req = s.req
        req.remaining -= 1
        if req.remaining == 0 and not req.cancelled:
            self._notify(req, [self._completion(x) for x in req.seqs])

    def _release_seq(self, s: _Seq) -> None:
        """Free `s`'s KV slot, and its request's LoRA slot with the last of its choices."""
        if self._running.get(s.slot) is not s:
            return
        del self._running[s.slot]
        self.live_prompts.release(s)
        self.kv.release(s.slot)
        heapq.heappush(self._free, s.slot)
        req = s.req
        if req.lora_slot >= 0 and not any(self._running.get(x.slot) is x for x in req.seqs):
            self.lora.release(req.lora_slot)

    def _completion(self, s: _Seq) -> Completion:
        text = self._tok.decode(s.tokens, skip_special_tokens=True)
        if s.cut is not None:
            text = text[: s.cut]
        return Completion(s.tokens, s.logprobs, s.tops, s.finish or "length", text, s.stop_reason)

    def _notify(self, req: _Request, result, callback=None) -> None:
        try:
            (callback or req.on_done)(result)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
            log.exception("request %s callback failed", req.id)

    def _fail_running(self, error: Exception) -> None:
        step, self._inflight = self._inflight, None
        if step is not None:
            try:  # the device may still be writing its slots and host buffers: let it finish first
                step.launched.fetch()
            except Exception:  # noqa: BLE001 - the step's own failure is the one being reported
                log.exception("the step in flight failed too")
        reqs = {id(s.req): s.req for s in self._running.values() if not s.req.cancelled and s.req.remaining}
        for seq in list(self._running.values()):
            seq.req.cancelled = True
            self._release_seq(seq)
        for req in reqs.values():
            self._notify(req, error)

    def _fail_all(self, error: Exception, items: list) -> None:
        self._fail_running(error)
        for req in list(self._waiting) + [i for i in items if isinstance(i, _Request)]:
            self._notify(req, error)
        self._waiting.clear()
