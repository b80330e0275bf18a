"""The benchmarks' HTTP load client: closed-loop workers sending ``/v1/completions`` requests, in one process or
spread over several.

Every worker sends its next request when its previous one is answered; requests are numbered, and each number is
taken once by whichever worker is free (`closed_loop`). A pass reports every request's latency (and TTFT when
streamed), the completion tokens, and the wall time from the first send to the last answer.

Why several processes (``processes``): one Python process has one event loop and one GIL, and at c=64 the client's
own CPU per request (httpx: building and sending the request, reading and JSON-parsing the answer; streamed, one line
and one JSON parse per chunk) can be what sets the figure rather than the server. With ``processes = N`` the workers
are split over N spawned processes that take request numbers from one shared counter, start together once all are
ready, and report their requests back; the pass is merged exactly: tokens = the sum over all processes, wall = first
send (earliest start) -> last answer (latest end), both read from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux,
one clock for every process of the machine). The client code per request is the same either way, for every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ADAPTER = "policy@1"
WORKERS_PER_POOL = 16
# one client process per this many workers (one pool's worth): one process for all 64 added 0.11-0.19 s to the TTFT
# of a wave of 64 on a 2-core CPU (benchmarks/results/serving-intake-cpu.md); 16 is not tuned beyond that
WORKERS_PER_PROCESS = 16
MAX_PROCESSES = 8


@dataclass
class Load:
    """One workload: `requests` requests from `concurrency` closed-loop clients, each `n` samples."""

    name: str
    concurrency: int
    requests: int
    prompt_tokens: int
    new_tokens: int
    n: int = 1
    warmup_requests: int = 0  # default: one wave (concurrency requests)
    ttft_requests: int = 0  # default: one wave


@dataclass
class Pass:
    """What the workers of one process measured; `start`/`end` are perf_counter times of the first send and the
    last answer."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    start: float = 0.0
    end: float = 0.0


def default_processes(concurrency: int) -> int:
    """Client processes for `concurrency` workers: one per `WORKERS_PER_PROCESS`, at most `MAX_PROCESSES`."""
    return max(1, min(MAX_PROCESSES, math.ceil(concurrency / WORKERS_PER_PROCESS)))


def prompt_ids(load: str, phase: str, index: int, length: int, vocab: int) -> list[int]:
    """Random ids in [3, vocab) (0-2 are tiny-random's special tokens), fixed by (load, phase, index)."""
    rng = random.Random(f"{load}/{phase}/{index}")
    return [rng.randrange(3, vocab) for _ in range(length)]


def body_for(load: Load, phase: str, index: int, vocab: int, seeded: bool, stream: bool) -> dict:
    body = {"model": ADAPTER, "prompt": prompt_ids(load.name, phase, index, load.prompt_tokens, vocab),
            "max_tokens": load.new_tokens, "min_tokens": load.new_tokens, "ignore_eos": True, "n": load.n,
            "temperature": 1.0, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    if seeded:
        body["seed"] = index
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(http, body: dict, expected: int) -> tuple[float, float | None, int]:
    """(latency s, TTFT s or None, completion tokens) of one request; raises if a sample is not `expected` long."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        reply = await http.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:500]}")
        data = reply.json()
        latency = time.perf_counter() - t0
        lengths = [len(c["token_ids"]) for c in data["choices"]]
        if len(lengths) != body["n"] or any(n != expected for n in lengths):
            raise RuntimeError(f"expected {body['n']} samples of {expected} tokens, got {lengths}")
        return latency, None, sum(lengths)
    ttft, counts, usage = None, {}, None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:500]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload.strip() == "[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or []:
                got = len(choice.get("token_ids") or [])
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                counts[choice["index"]] = counts.get(choice["index"], 0) + got
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    lengths = [counts.get(i, 0) for i in range(body["n"])]
    if any(n != expected for n in lengths):
        raise RuntimeError(f"streamed: expected {body['n']} samples of {expected} tokens, got {lengths}")
    if usage and usage.get("completion_tokens") != sum(lengths):
        raise RuntimeError(f"streamed: usage says {usage.get('completion_tokens')} tokens, chunks {sum(lengths)}")
    return latency, ttft, sum(lengths)


async def run_workers(base_url: str, load: Load, phase: str, vocab: int, seeded: bool, stream: bool, workers: int,
                      next_index: Callable[[], int | None], ready: Callable[[], None] = lambda: None) -> Pass:
    """`workers` closed-loop workers taking request numbers from `next_index` (None: no more); `ready()` is called
    once the clients exist, just before the first send.

    Every `WORKERS_PER_POOL` workers share one ``httpx.AsyncClient`` (one connection each): httpx's pool scans all
    its connections for every request it sends and every answer it closes, so one pool for 256 workers spent ~90% of
    this process's CPU in the scans (py-spy), its event loop fell seconds behind, and the client, not the server,
    set the c=256 figure (`benchmarks/results/serving-overhead-cpu.md`)."""
    import httpx

    out = Pass()
    limits = httpx.Limits(max_connections=WORKERS_PER_POOL, max_keepalive_connections=WORKERS_PER_POOL)
    async with contextlib.AsyncExitStack() as stack:
        pools = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(900.0), limits=limits))
            for _ in range(-(-workers // WORKERS_PER_POOL))]

        async def worker(http):
            while (i := next_index()) is not None:
                latency, ttft, produced = await one_request(
                    http, body_for(load, phase, i, vocab, seeded, stream), load.new_tokens)
                out.latencies.append(latency)
                out.tokens += produced
                if ttft is not None:
                    out.ttfts.append(ttft)

        ready()
        out.start = time.perf_counter()
        await asyncio.gather(*[worker(pools[w // WORKERS_PER_POOL]) for w in range(workers)])
        out.end = time.perf_counter()
    return out


async def closed_loop(base_url: str, load: Load, phase: str, total: int, vocab: int, seeded: bool, stream: bool,
                      processes: int = 1):
    """`load.concurrency` workers sending `total` requests, in `processes` client processes; (latencies, ttfts,
    tokens, wall s)."""
    workers = min(load.concurrency, total)
    if processes <= 1 or workers <= 1:
        numbers = iter(range(total))
        one = await run_workers(base_url, load, phase, vocab, seeded, stream, workers, lambda: next(numbers, None))
        return one.latencies, one.ttfts, one.tokens, one.end - one.start
    passes = await asyncio.to_thread(across_processes, base_url, load, phase, total, vocab, seeded, stream,
                                     workers, min(processes, workers))
    return ([x for p in passes for x in p.latencies], [x for p in passes for x in p.ttfts],
            sum(p.tokens for p in passes), max(p.end for p in passes) - min(p.start for p in passes))


def across_processes(base_url: str, load: Load, phase: str, total: int, vocab: int, seeded: bool, stream: bool,
                     workers: int, processes: int, timeout: float = 1800) -> list[Pass]:
    """Run `workers` workers split over `processes` spawned processes sharing one request counter; their `Pass`es."""
    ctx = multiprocessing.get_context("spawn")  # the parent may hold CUDA and threads: no fork
    counter, ready, go, results = ctx.Value("l", 0), ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    shares = [workers // processes + (i < workers % processes) for i in range(processes)]
    children = [ctx.Process(target=_child, args=(base_url, load, phase, total, vocab, seeded, stream, share, counter,
                                                 ready, go, results), daemon=True) for share in shares]
    for child in children:
        child.start()
    try:
        for _ in children:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a client process did not start within 120 s")
        go.set()
        outcomes = [results.get(timeout=timeout) for _ in children]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    errors = [value for kind, value in outcomes if kind == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} of {processes} client processes failed: {errors[0]}")
    return [value for _, value in outcomes]


def _child(base_url, load, phase, total, vocab, seeded, stream, workers, counter, ready, go, results) -> None:
    def next_index() -> int | None:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i if i < total else None

    started = []

    def start() -> None:
        started.append(True)
        ready.release()
        go.wait()  # blocks this process's loop before any request: every process starts sending together

    try:
        results.put(("ok", asyncio.run(run_workers(base_url, load, phase, vocab, seeded, stream, workers, next_index,
                                                   start))))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        if not started:
            ready.release()  # the parent waits for every process's start before it collects results
        results.put(("error", f"{type(e).__name__}: {e}"[:2000]))


def quantiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {"mean": round(statistics.fmean(v), 4), "p50": round(v[len(v) // 2], 4),
            "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 4)}
