"""How the engine thread hands back results and the GIL: requests finishing in one engine step wake their loop once,
and the engine lowers the interpreter's switch interval so it gets the GIL back soon after each device wait."""

from __future__ import annotations

import asyncio

import pytest

from backends.inference.engine import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=16))
    yield engine
    engine.shutdown()


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
