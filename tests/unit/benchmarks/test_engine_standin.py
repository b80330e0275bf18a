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
    assert abs(counters.decode_device_s - 9 * 0.020) < 1e-9
    assert wall >= 9 * 0.020


def test_a_standin_step_returns_at_once_and_its_output_waits_like_a_cuda_stream(tiny_hf):
    """Two steps launched back to back: both launches return at once, the first output is readable after one step's
    time, the second after two (it starts when the first ends), and the wait counter says how long reads blocked."""
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8))
    try:
        counters = install(engine, StandInTiming(decode_base_ms=50, decode_per_row_ms=0))
        step = engine.step
        t0 = time.perf_counter()
        first, second = step.launch(4, 10, False, False), step.launch(4, 10, False, False)
        launched = time.perf_counter() - t0
        first.fetch()
        one = time.perf_counter() - t0
        second.fetch()
        two = time.perf_counter() - t0
    finally:
        engine.shutdown()
    assert launched < 0.025 and 0.045 <= one < 0.095 and two >= 0.095
    assert counters.decode_steps == 2 and abs(counters.decode_device_s - 0.1) < 1e-9
    assert 0.07 <= counters.decode_wait_s <= two


def test_overlapped_the_host_work_hides_behind_the_standin_steps(tiny_hf):
    """The same requests over the stand-in, serial then overlapped: overlapped, the engine's reads of step outputs
    block for less than the steps' device time (its bookkeeping ran meanwhile); serially, for all of it."""
    model, tok = tiny_hf
    waits = {}
    for overlap in (False, True):
        engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8, overlap_decode=overlap))
        try:
            counters = install(engine, StandInTiming(decode_base_ms=5, decode_per_row_ms=0, prefill_base_ms=1,
                                                     prefill_per_token_ms=0))
            out = engine.generate_sync([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True, seed=3,
                                                                 stop=["zzzz"]), n=4, timeout=60)
        finally:
            engine.shutdown()
        assert [len(c.token_ids) for c in out] == [40] * 4
        waits[overlap] = counters.decode_wait_s / counters.decode_device_s
    assert waits[False] > 0.97 and waits[True] < waits[False]


def test_the_standin_serves_an_adapter(tiny_hf, tmp_path):
    """A request on an adapter takes the engine's one-slot path, which asks the runner for merged weights."""
    import copy

    from benchmarks.inference import random_lora

    model, tok = tiny_hf
    random_lora(copy.deepcopy(model), 4, tmp_path / "adapter")
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8))
    try:
        engine.load_adapter("policy@1", str(tmp_path / "adapter"))
        counters = install(engine, StandInTiming(decode_base_ms=1, decode_per_row_ms=0))
        out = engine.generate_sync([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True, seed=3), "policy@1",
                                   n=2, timeout=30)
    finally:
        engine.shutdown()
    assert [len(c.token_ids) for c in out] == [6, 6] and counters.decode_steps == 5
    assert engine.stats["single_slot_steps"] == 5
