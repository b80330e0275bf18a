"""`EngineConfig.admission_wait_steps`: while sequences decode, newcomers wait for the oldest of them to have waited
that many decode steps (so that arrivals a few steps apart share one prefill), but never when nothing decodes or when
they would fill the free slots. Run with the overlapped loop too (its admissions drain the step in flight)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from backends.inference.engine import Completion, Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def waiting_engine(request, tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random",
                    EngineConfig(max_batch_size=8, admission_wait_steps=12, overlap_decode=request.param))
    yield engine
    engine.shutdown()


class LongRequest:
    """A long streamed request whose tokens, counted as they reach this loop, measure decode steps."""

    def __init__(self, engine: Engine, seed: int):
        self.tokens = 0
        self.started = asyncio.Event()
        self.stream = engine.stream([9, 8, 7], SamplingParams(max_tokens=400, ignore_eos=True, seed=seed))
        self.task = asyncio.ensure_future(self._read())

    async def _read(self):
        async for item in self.stream:
            if not isinstance(item[0], Completion):
                self.tokens += len(item)
                self.started.set()

    async def wait_for(self, tokens: int):
        while self.tokens < tokens:
            await asyncio.sleep(0.001)

    async def stop(self):
        self.task.cancel()  # the stream's own clean-up aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def test_a_newcomer_waits_for_its_steps_while_others_decode(waiting_engine):
    long = LongRequest(waiting_engine, seed=1)
    await long.started.wait()
    before = long.tokens
    first = await waiting_engine.generate([5, 6, 7], SamplingParams(max_tokens=1, seed=2))
    # admission can come no earlier than 12 steps after its arrival, and every step gave the long request a token
    assert long.tokens - before >= 12 - 1, f"admitted after {long.tokens - before} steps"
    assert len(first[0].token_ids) == 1
    await long.stop()


async def test_arrivals_a_few_steps_apart_share_one_prefill(waiting_engine):
    long = LongRequest(waiting_engine, seed=3)
    await long.started.wait()
    prefills = waiting_engine.stats["prefills"]
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=4)
    jobs = []
    for i in range(3):  # one request per step or so: today's engine would prefill each alone
        jobs.append(asyncio.ensure_future(waiting_engine.generate([5 + i, 6, 7], params)))
        await long.wait_for(long.tokens + 1)
    results = await asyncio.gather(*jobs)
    assert [len(r[0].token_ids) for r in results] == [4] * 3
    assert waiting_engine.stats["prefills"] - prefills == 1
    await long.stop()


async def test_no_wait_when_nothing_decodes_or_the_slots_would_fill(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=4, admission_wait_steps=1000))
    try:
        alone = await asyncio.wait_for(engine.generate([5, 6], SamplingParams(max_tokens=3, ignore_eos=True)), 60)
        assert len(alone[0].token_ids) == 3  # nothing decoding: admitted at once
        long = LongRequest(engine, seed=5)
        await long.started.wait()
        fills = await asyncio.wait_for(  # n = 3 fills the 3 free slots: waiting longer cannot make it bigger
            engine.generate([5, 6], SamplingParams(max_tokens=2, ignore_eos=True, seed=6), n=3), 60)
        assert [len(c.token_ids) for c in fills] == [2] * 3 and long.tokens < 400
        await long.stop()
    finally:
        engine.shutdown()


def test_default_waits_on_cuda_only():
    assert EngineConfig().admission_wait_steps is None  # resolved by the engine: 4 on CUDA, 0 on the CPU
    with pytest.raises(ValueError):
        EngineConfig(admission_wait_steps=-1)
