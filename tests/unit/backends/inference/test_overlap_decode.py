"""Overlapped decode (`EngineConfig.overlap_decode`): step t+1 is launched before step t's tokens are accepted, and
the completions are exactly those of the serial loop (seeded sampling: same tokens, logprobs, top logprobs, finish
reasons, texts), with aborts and failed steps handled as serially. Forced on here: on the CPU its default is off."""

from __future__ import annotations

import asyncio

import pytest

from backends.inference.cuda_graphs import Launched
from backends.inference.engine import Engine, EngineConfig, SamplingParams
from tests.fixtures_server import wait_until

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33], [40, 41, 42], [50, 51, 52, 53, 54, 55]]


@pytest.fixture(scope="module")
def engines(tiny_hf, random_adapter):
    """{overlap: engine} of tiny-random with the random adapter as pol@1: serial and overlapped."""
    model, tok = tiny_hf
    made = {}
    for overlap in (False, True):
        made[overlap] = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=16, max_loras=2,
                                                                       overlap_decode=overlap))
        made[overlap].load_adapter("pol@1", str(random_adapter[0]))
    assert (made[False].overlap, made[True].overlap) == (False, True)
    yield made
    for engine in made.values():
        engine.shutdown()


def mixed_requests(engines) -> list[tuple[list[int], SamplingParams, str | None, int]]:
    """Seeded requests that end at different steps for different reasons: length, a stop token, a stop string, an
    end-of-turn token, with n > 1, top logprobs, top-p, greedy rows, LoRA and base rows in one batch. The stops are
    placed where a probe run (same seeds and sampling) shows the model emits them."""
    serial = engines[False]
    probe = SamplingParams(max_tokens=24, seed=2, ignore_eos=True)
    stop_tok = serial.generate_sync(PROMPTS[1], probe, timeout=60)[0]
    probe3 = SamplingParams(max_tokens=24, seed=3, ignore_eos=True)
    stop_txt = serial.generate_sync(PROMPTS[2], probe3, timeout=60)[0]
    probe5 = SamplingParams(max_tokens=24, seed=5, ignore_eos=True)
    eos = serial.generate_sync(PROMPTS[4], probe5, "pol@1", timeout=60)[0]
    # tiny-random hardly ever samples its end-of-turn id; both engines take one it does sample as another
    for engine in engines.values():
        engine.eos_ids = frozenset(engine.eos_ids) | {eos.token_ids[9]}
    text = stop_txt.text
    cut = len(serial.tokenizer.decode(stop_txt.token_ids[:6], skip_special_tokens=True))
    stop_string = text[cut: cut + 3] if text[cut: cut + 3].strip() else text[cut - 3: cut]
    assert stop_string.strip(), "the probe gave no usable stop string"
    return [
        (PROMPTS[0], SamplingParams(max_tokens=7, seed=1, ignore_eos=True), None, 1),
        (PROMPTS[1], SamplingParams(max_tokens=24, seed=2, ignore_eos=True,
                                    stop_token_ids=[stop_tok.token_ids[4]]), None, 1),
        (PROMPTS[2], SamplingParams(max_tokens=24, seed=3, ignore_eos=True, stop=[stop_string]), None, 1),
        (PROMPTS[3], SamplingParams(max_tokens=12, seed=4, temperature=0.8, top_p=0.9, top_logprobs=2,
                                    ignore_eos=True), "pol@1", 3),
        (PROMPTS[4], SamplingParams(max_tokens=24, seed=5), "pol@1", 1),
        (PROMPTS[5], SamplingParams(max_tokens=15, seed=6, temperature=0, top_logprobs=3, ignore_eos=True),
         None, 2),
        (PROMPTS[0], SamplingParams(max_tokens=1, seed=7, ignore_eos=True), "pol@1", 1),
        (PROMPTS[2], SamplingParams(max_tokens=9, seed=8, ignore_eos=True, stop_token_ids=[stop_tok.token_ids[4]]),
         "pol@1", 2),
    ]


def assert_alike(got, want) -> None:
    """Same tokens, finish reasons, texts and top-logprob ids; logprobs up to float rounding. For runs whose batches
    were composed differently (requests arriving at other steps): a batch of one row takes another matmul kernel on
    the CPU than a batch of several, which moves logprobs by ~1e-7."""
    assert [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in got] == \
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in a.top_logprobs or []] == [[t for t, _ in top] for top in
                                                                         b.top_logprobs or []]


async def run_all(engine: Engine, requests, stagger: bool) -> list:
    """Submit `requests` in one admission (the engine's lock held while they queue), or the second half once the
    first is decoding (admissions mid-decode drain the step in flight)."""
    first, second = (requests[: len(requests) // 2], requests[len(requests) // 2:]) if stagger else (requests, [])
    steps = engine.stats["decode_steps"]
    with engine._cv:
        jobs = [asyncio.ensure_future(engine.generate(p, s, m, n)) for p, s, m, n in first]
        await asyncio.sleep(0)
    if second:
        await wait_until(lambda: engine.stats["decode_steps"] > steps + 2, 30, "decoding to start")
        jobs += [asyncio.ensure_future(engine.generate(p, s, m, n)) for p, s, m, n in second]
    return await asyncio.wait_for(asyncio.gather(*jobs), 120)


@pytest.mark.parametrize("stagger", [False, True], ids=["one-admission", "staggered"])
async def test_overlapped_completions_equal_serial_ones(engines, stagger):
    requests = mixed_requests(engines)
    results = {}
    for overlap, engine in engines.items():
        results[overlap] = await run_all(engine, requests, stagger)
    if stagger:  # the second wave joins at whatever step each engine is at: other batches, same sequences
        for got, want in zip(results[True], results[False]):
            assert_alike(got, want)
    else:  # the same batches, but for the overlapped steps' extra rows: exactly the same numbers
        assert results[True] == results[False]
    flat = [c for r in results[False] for c in r]
    reasons = {(c.finish_reason, type(c.stop_reason).__name__) for c in flat}
    assert reasons == {("length", "NoneType"), ("stop", "int"), ("stop", "str"), ("stop", "NoneType")}, reasons
    assert len({len(c.token_ids) for c in flat}) >= 5  # sequences end at different steps
    assert all(c.top_logprobs and len(c.top_logprobs) == len(c.token_ids) for c in results[True][3])
    for engine in engines.values():
        await wait_until(lambda e=engine: e.activity()["running"] == 0, 10, "every slot to be freed")
        assert sorted(engine._free) == list(range(engine.max_batch))


def poison_extra_rows(engine: Engine, monkeypatch) -> list[int]:
    """Make every decode row of an already-finished sequence (an overlapped step's extra row) come back as token
    vocab-1 with logprob +0.5 (no real logprob is positive); returns a list that counts them."""
    poisoned: list[int] = []
    launch = engine.step.launch

    def spied(*args, **kwargs) -> Launched:
        launched = launch(*args, **kwargs)
        fetch = launched.fetch

        def poisoned_fetch():
            out, tops = fetch()
            out = out.clone()
            for slot, seq in list(engine._running.items()):
                if seq.finish is not None and slot < out.shape[1]:
                    out[0, slot], out[1, slot] = engine.vocab - 1, 0.5
                    poisoned.append(slot)
            return out, tops

        launched.fetch = poisoned_fetch
        return launched

    monkeypatch.setattr(engine.step, "launch", spied)
    return poisoned


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
async def test_the_extra_row_of_a_finished_sequence_never_reaches_its_completion(engines, monkeypatch, overlap):
    engine = engines[overlap]
    probe = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=24, seed=2, ignore_eos=True))
    stop = probe[0].token_ids[4]
    poisoned = poison_extra_rows(engine, monkeypatch)
    long = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, seed=9, ignore_eos=True)))
    out = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=24, seed=2, ignore_eos=True,
                                                           stop_token_ids=[stop]), n=2)
    await long
    first_stop = probe[0].token_ids.index(stop)
    assert (out[0].finish_reason, out[0].stop_reason) == ("stop", stop)
    assert out[0].token_ids == probe[0].token_ids[: first_stop + 1]
    assert out[0].logprobs == pytest.approx(probe[0].logprobs[: first_stop + 1], abs=1e-5)  # alone vs in a batch
    assert all(lp < 0.5 for c in out for lp in c.logprobs) and engine.vocab - 1 not in out[0].token_ids
    # overlapped, the stopped rows were stepped once more (and dropped); serially never
    assert bool(poisoned) == overlap


async def test_an_abort_mid_decode_frees_the_slots_and_leaves_the_others_alone(engines):
    engine, serial = engines[True], engines[False]
    params = SamplingParams(max_tokens=40, seed=11, ignore_eos=True, top_logprobs=1)
    reference = await serial.generate(PROMPTS[3], params, "pol@1")
    doomed = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True),
                                                   "pol@1", n=8))
    other = asyncio.ensure_future(engine.generate(PROMPTS[3], params, "pol@1"))
    await wait_until(lambda: engine.activity()["running"] == 9, 30, "the 9 sequences to run")
    steps = engine.stats["decode_steps"]
    await wait_until(lambda: engine.stats["decode_steps"] > steps + 3, 30, "a few decode steps")
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert_alike(await asyncio.wait_for(other, 60), reference)
    # every slot is needed again: this only finishes if the aborted request released its 8
    done = await asyncio.wait_for(engine.generate([5, 6, 7], SamplingParams(max_tokens=3), n=16), 60)
    assert len(done) == 16


class StepFailed(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "output read"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
async def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(engines, monkeypatch, overlap, where):
    engine = engines[overlap]
    params = SamplingParams(max_tokens=12, seed=13, ignore_eos=True)
    reference = await engines[False].generate(PROMPTS[2], params)
    calls = {"n": 0}
    if where == "forward":
        decode = engine.runner.decode

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise StepFailed("the device fell over")
            return decode(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "decode", failing)
    else:
        launch = engine.step.launch

        def failing_launch(*args, **kwargs):
            launched = launch(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 4:
                def wait():
                    raise StepFailed("the device fell over")
                launched.wait = wait
            return launched

        monkeypatch.setattr(engine.step, "launch", failing_launch)
    with pytest.raises(StepFailed):
        await asyncio.wait_for(asyncio.gather(engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, seed=1)),
                                              engine.generate(PROMPTS[1], params, "pol@1", n=2)), 60)
    await wait_until(lambda: engine.activity()["running"] == 0, 10, "the failed sequences to be freed")
    assert engine.alive and engine._inflight is None
    assert await asyncio.wait_for(engine.generate(PROMPTS[2], params), 60) == reference
    assert sorted(engine._free) == list(range(engine.max_batch))
