"""The engine without HTTP: the fused-projection path (the CUDA default) gives the same numbers, on the CPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from backends.inference.engine import Engine, EngineConfig, RequestError, SamplingParams
from tests.fixtures_server import wait_until
from tests.unit.backends.serving.test_server import MESSAGES, teacher_forced_logprobs


@pytest.fixture(scope="module")
def fused_engine(tiny_hf, random_adapter):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(fuse_projections=True, max_batch_size=8, max_loras=2))
    engine.load_adapter("pol@1", str(random_adapter[0]))
    yield engine
    engine.shutdown()


async def test_fused_projections_match_hf_and_peft_in_a_mixed_batch(fused_engine, tiny_hf, random_adapter):
    tok = tiny_hf[1]
    prompt = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    params = SamplingParams(max_tokens=20, seed=4, ignore_eos=True)
    base, tuned = await asyncio.gather(fused_engine.generate(prompt, params, "tiny-random", n=2),
                                       fused_engine.generate(prompt, params, "pol@1", n=2))
    for ref, completions in ((tiny_hf[0], base), (random_adapter[1], tuned)):
        for c in completions:
            torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced_logprobs(ref, prompt, c.token_ids),
                                       atol=1e-4, rtol=1e-4)


async def test_more_choices_than_slots_is_a_request_error(fused_engine):
    with pytest.raises(RequestError, match="n must be"):
        fused_engine.submit([1, 2, 3], SamplingParams(max_tokens=2), n=9)


async def test_cancelled_request_frees_its_slots(fused_engine):
    task = asyncio.create_task(fused_engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True),
                                                     n=8))
    await wait_until(lambda: fused_engine.activity()["running"] == 8, 30, "the 8 sequences to run")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # all 8 slots are needed again right away: this only finishes if the cancelled request released them
    done = await asyncio.wait_for(fused_engine.generate([5, 6, 7], SamplingParams(max_tokens=3), n=8), 30)
    assert len(done) == 8
