"""The serving-overhead benchmark's engine stand-in still fits the engine it stands in for (its runner and decode
step interfaces), and sleeps and counts as it says."""

from __future__ import annotations

import time

from backends.inference.engine import Engine, EngineConfig, SamplingParams
from benchmarks.engine_standin import StandInTiming, install


def test_the_standin_drives_the_real_engine(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8))
    try:
        counters = install(engine, StandInTiming(decode_base_ms=20, decode_per_row_ms=0, prefill_base_ms=1,
                                                 prefill_per_token_ms=0))
        t0 = time.perf_counter()
        out = engine.generate_sync([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, seed=3), n=2, timeout=30)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    assert [len(c.token_ids) for c in out] == [10, 10] and out[0].token_ids != out[1].token_ids
    first, stop = engine.standin["token_ids"]
    assert all(first <= t < stop for c in out for t in c.token_ids[1:])  # decoded tokens: ordinary ids
    assert out[0].text == tok.decode(out[0].token_ids, skip_special_tokens=True)
    assert (counters.prefills, counters.decode_steps, counters.decode_rows) == (1, 9, 18)
    assert wall >= 9 * 0.020
