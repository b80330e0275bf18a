"""Per-request timeline of the embedded server (benchmarks only): where a completion request's time goes between its
arrival and its admission, and between its last token and its answer being written.

`IntakeMiddleware` wraps the ASGI app and `IntakeClock.wrap_engine` the engine's `submit_all` (which `submit` calls)
and `_prefill` (instance attributes: nothing of the product changes); together they record, for every
``POST /v1/completions``, perf_counter times of:

- ``arrival``: the ASGI call starts (the request line and headers are parsed);
- ``submit``: the engine is handed the request (body read, parsed, validated, prompts checked: on the loop or in a
  worker job with its hops);
- ``admit`` / ``prefilled``: the engine starts / ends the prefill that admits it (waiting in the inbox and the
  admission policy before, the prefill between);
- ``engine_first``: the engine hands over its first tokens (streamed requests) and ``engine_done`` its completions;
- ``first_write``: the first body bytes are sent (streamed: the first chunks, with the first tokens);
- ``end``: the last body bytes are sent.

`phases` turns the records into the phase durations of each request, `summary` into their medians and the wave's
spread (first to last arrival, admission, first write).
"""

from __future__ import annotations

import contextvars
import statistics
import threading
import time

_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("intake_record", default=None)

PHASES = (("parse", "arrival", "submit"), ("admission_wait", "submit", "admit"), ("prefill", "admit", "prefilled"),
          ("first_write", "prefilled", "first_write"), ("decode", "prefilled", "engine_done"),
          ("answer", "engine_done", "end"), ("total", "arrival", "end"))


class IntakeClock:
    def __init__(self):
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.by_id: dict[int, dict] = {}

    def take(self) -> list[dict]:
        with self.lock:
            out, self.records, self.by_id = self.records, [], {}
        return out

    def wrap_engine(self, engine) -> None:
        clock, submit_all, prefill = self, engine.submit_all, engine._prefill

        def timed_submit_all(prompts, params, model=None, n=1, on_done=None, on_tokens=None):
            record = _current.get()
            if record is None:
                return submit_all(prompts, params, model, n, on_done, on_tokens)

            def done(callback):
                def timed(result):
                    record.setdefault("engine_done", time.perf_counter())
                    if callback is not None:
                        callback(result)
                return timed

            def tokens(callback):
                def timed(accepted):
                    record.setdefault("engine_first", time.perf_counter())
                    callback(accepted)
                return timed if callback is not None else None

            record.setdefault("submit", time.perf_counter())
            rids = submit_all(prompts, params, model, n, [done(c) for c in on_done or [None] * len(prompts)],
                              [tokens(c) for c in on_tokens or [None] * len(prompts)])
            with clock.lock:
                clock.by_id.update(dict.fromkeys(rids, record))
            return rids

        def timed_prefill(reqs):
            t0 = time.perf_counter()
            prefill(reqs)
            t1 = time.perf_counter()
            with clock.lock:
                for req in reqs:
                    record = clock.by_id.get(req.id)
                    if record is not None:
                        record.setdefault("admit", t0)
                        record.setdefault("prefilled", t1)

        engine.submit_all, engine._prefill = timed_submit_all, timed_prefill


class IntakeMiddleware:
    """ASGI middleware (``app.add_middleware(IntakeMiddleware, clock=clock)``): the HTTP side of the timeline."""

    def __init__(self, app, clock: IntakeClock):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        record = {"arrival": time.perf_counter()}
        with self.clock.lock:
            self.clock.records.append(record)
        token = _current.set(record)

        async def sending(message):
            if message["type"] == "http.response.body":
                now = time.perf_counter()
                record.setdefault("first_write", now)
                if not message.get("more_body", False):
                    record["end"] = now
            await send(message)

        try:
            return await self.app(scope, receive, sending)
        finally:
            _current.reset(token)


def phases(record: dict) -> dict[str, float]:
    """Milliseconds of each phase of one record (those whose ends were both recorded)."""
    return {name: 1000 * (record[b] - record[a]) for name, a, b in PHASES if a in record and b in record}


def summary(records: list[dict]) -> dict:
    """Median ms of each phase over the records, and the spread (ms from the first to the last) of arrivals,
    admissions and first writes."""
    per = [phases(r) for r in records]
    out = {"requests": len(records), "median_ms": {}}
    for name, _, _ in PHASES:
        values = [p[name] for p in per if name in p]
        if values:
            out["median_ms"][name] = round(statistics.median(values), 3)
    for key in ("arrival", "admit", "first_write"):
        times = [r[key] for r in records if key in r]
        if times:
            out[f"{key}_spread_ms"] = round(1000 * (max(times) - min(times)), 3)
    out["admissions"] = len({r["admit"] for r in records if "admit" in r})
    return out
