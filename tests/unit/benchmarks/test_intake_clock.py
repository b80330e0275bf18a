"""benchmarks/intake_clock.py: a request's timeline through the real app and engine (stand-in), and its phases."""

from __future__ import annotations

import httpx

from backends.inference.engine import Engine, EngineConfig
from backends.serving.app import create_app
from benchmarks.engine_standin import StandInTiming, install
from benchmarks.intake_clock import IntakeClock, IntakeMiddleware, phases, summary


async def test_a_completion_leaves_a_full_timeline(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8))
    try:
        install(engine, StandInTiming(decode_base_ms=1, decode_per_row_ms=0, prefill_base_ms=1,
                                      prefill_per_token_ms=0))
        app, clock = create_app(engine), IntakeClock()
        clock.wrap_engine(engine)
        app.add_middleware(IntakeMiddleware, clock=clock)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for stream in (False, True):
                reply = await http.post("/v1/completions", json={"model": "tiny-random", "prompt": [5, 6, 7],
                                                                 "max_tokens": 4, "ignore_eos": True,
                                                                 "stream": stream})
                assert reply.status_code == 200
            await http.get("/v1/models")  # not a completion: not recorded
    finally:
        engine.shutdown()
    records = clock.take()
    assert len(records) == 2 and clock.take() == []
    keys = ("arrival", "submit", "admit", "prefilled", "engine_done", "first_write", "end")
    for r in records:
        assert all(k in r for k in keys)
        assert r["arrival"] <= r["submit"] <= r["admit"] <= r["prefilled"] <= r["engine_done"] <= r["end"]
        assert all(v >= 0 for v in phases(r).values())
    assert "engine_first" in records[1] and "engine_first" not in records[0]  # streamed only
    s = summary(records)
    assert s["requests"] == 2 and s["admissions"] == 2 and set(s["median_ms"]) >= {"parse", "prefill", "total"}
