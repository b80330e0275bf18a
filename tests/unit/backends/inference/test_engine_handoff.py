"""How requests reach the engine thread and it hands back results and the GIL: the prompts of one request
(`submit_all`) are checked before any is queued and admitted in one prefill, their streamed answer equals the plain
one exactly, and closing it aborts them all; requests finishing in one engine step wake their loop once, streamed
requests' tokens come in that same wake-up (one per step, however many rows stream), and the engine lowers the
interpreter's switch interval so it gets the GIL back soon after each device wait."""

from __future__ import annotations

import asyncio

import pytest

from backends.inference.engine import Completion, Engine, EngineConfig, RequestError, SamplingParams
from tests.fixtures_server import wait_until


@pytest.fixture(scope="module")
def engine(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=16))
    yield engine
    engine.shutdown()


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


async def _idle(engine) -> None:
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}
                     and len(engine._free) == engine.max_batch, 30, "an idle engine")


async def test_a_requests_prompts_are_admitted_in_one_prefill_and_stream_as_they_answer(engine):
    params = SamplingParams(max_tokens=20, seed=4, top_logprobs=2)
    await _idle(engine)
    before = engine.stats["prefills"]
    plain = await engine.generate_all(PROMPTS, params, n=2)
    assert engine.stats["prefills"] == before + 1
    streamed: dict[int, list] = {}
    async for index, item in engine.stream_all(PROMPTS, params, n=2):
        if isinstance(item[0], Completion):
            streamed[index] = item
    assert engine.stats["prefills"] == before + 2
    assert [streamed[i] for i in range(len(PROMPTS))] == plain  # the same batches: the same float32 numbers


async def test_a_bad_prompt_among_them_queues_none(engine):
    await _idle(engine)
    ids, requests = engine._ids, engine.stats["requests"]
    with pytest.raises(RequestError):
        engine.submit_all([[5, 6], [engine.vocab]], SamplingParams(max_tokens=4))
    await asyncio.sleep(0.05)
    assert (engine._ids, engine.stats["requests"]) == (ids, requests)


async def test_closing_a_requests_stream_aborts_every_prompt(engine):
    await _idle(engine)
    stream = engine.stream_all(PROMPTS[:2], SamplingParams(max_tokens=500, ignore_eos=True, seed=5), n=2)
    _, first = await anext(stream)
    assert not isinstance(first[0], Completion)
    assert engine.activity()["running"] == 4
    await stream.aclose()
    await _idle(engine)


def test_an_abort_after_shutdown_is_a_no_op(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=2))
    engine.shutdown()
    engine.abort(1)  # the request it would stop is failed already: nothing to raise


class CountingWakeUps:
    """Counts the calls the engine thread makes into `loop` (the real loop's own method, counted)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.count, self._real = 0, loop.call_soon_threadsafe

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._real(*args, **kwargs)


async def test_requests_finishing_in_one_step_wake_the_loop_once(engine, monkeypatch):
    loop = asyncio.get_running_loop()
    wake_ups = CountingWakeUps(loop)
    monkeypatch.setattr(loop, "call_soon_threadsafe", wake_ups)
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=1)
    # 12 requests of the same length, all queued before the engine thread looks (its condition's lock is reentrant:
    # this thread's submits go through while the engine thread waits): one prefill admits them, one step ends them
    with engine._cv:
        jobs = [asyncio.ensure_future(engine.generate([5 + i, 6, 7], params)) for i in range(12)]
        await asyncio.sleep(0)  # each job runs up to its submit
    results = await asyncio.gather(*jobs)
    assert [len(r[0].token_ids) for r in results] == [6] * 12
    assert wake_ups.count <= 2, f"{wake_ups.count} wake-ups for 12 requests finishing together"


async def _read(stream) -> tuple[list[list[int]], list[Completion]]:
    """(per choice the streamed token ids, the completions) of one `Engine.stream`."""
    tokens: dict[int, list[int]] = {}
    completions = None
    async for item in stream:  # to its end: a generator left open would be closed by a call into the loop
        if isinstance(item[0], Completion):
            completions = item
        else:
            for accepted in item:
                tokens.setdefault(accepted.choice, []).append(accepted.token)
    return [tokens[c] for c in sorted(tokens)], completions


async def test_streamed_rows_wake_the_loop_once_per_step(engine, monkeypatch):
    loop = asyncio.get_running_loop()
    wake_ups = CountingWakeUps(loop)
    monkeypatch.setattr(loop, "call_soon_threadsafe", wake_ups)
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=4)
    with engine._cv:  # as above: one prefill admits all 6 requests (12 rows), then 9 decode steps
        jobs = [asyncio.ensure_future(_read(engine.stream([5 + i, 6, 7], params, n=2))) for i in range(6)]
        await asyncio.sleep(0)
    results = await asyncio.gather(*jobs)
    for streamed, completions in results:
        assert streamed == [c.token_ids for c in completions] and all(len(t) == 10 for t in streamed)
    assert wake_ups.count <= 10 + 2, f"{wake_ups.count} wake-ups for 12 rows streamed over 10 steps"


async def test_closing_a_stream_aborts_its_request(engine):
    await asyncio.sleep(0.05)
    stream = engine.stream([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True, seed=5), n=3)
    first = await anext(stream)
    assert first and not isinstance(first[0], Completion)
    await stream.aclose()
    for _ in range(500):
        if engine.activity() == {"waiting": 0, "running": 0}:
            break
        await asyncio.sleep(0.01)
    assert engine.activity() == {"waiting": 0, "running": 0} and len(engine._free) == engine.max_batch


async def test_each_loop_gets_its_own_results(engine):
    """Two event loops (threads) awaiting at once: every result reaches the loop that asked for it."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=2)

    def run_in_own_loop(first: int):
        async def main():
            return await asyncio.gather(*[engine.generate([first + i, 9], params) for i in range(4)])

        return asyncio.run(main())

    a, b = await asyncio.gather(asyncio.to_thread(run_in_own_loop, 10), asyncio.to_thread(run_in_own_loop, 30))
    solo = await engine.generate([10, 9], params)
    assert len(a) == len(b) == 4 and a[0][0].token_ids == solo[0].token_ids


def test_an_engine_lowers_the_interpreters_switch_interval(engine):
    """The engine thread gets the GIL back within SWITCH_INTERVAL_S after each device wait, not 5 ms later."""
    import sys

    from backends.inference.engine import SWITCH_INTERVAL_S

    assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
