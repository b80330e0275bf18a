"""The compiled decode step (`compile_decode`, with LoRA's A fused into the base GEMM): it compiles at engine start
and when adapters are first placed, never again for other batch sizes or mixes, and gives HF's and peft's numbers.
Inductor's C++ backend here; on CUDA the same traced graphs go to Triton."""

from __future__ import annotations

import asyncio

import pytest
import torch

from backends.inference.engine import Engine, EngineConfig, SamplingParams
from tests.unit.backends.serving.test_server import MESSAGES, teacher_forced_logprobs


@pytest.fixture
def compiled_engine(tiny_hf):
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8, max_loras=2, fuse_lora_a=True,
                                                             compile_decode=True))
    yield engine
    engine.shutdown()


async def test_compiles_at_start_and_first_adapter_then_serves_any_batch(compiled_engine, tiny_hf, random_adapter):
    engine, (model, tok) = compiled_engine, tiny_hf
    fns = engine.runner.fns
    prompt = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    params = SamplingParams(max_tokens=6, seed=5, ignore_eos=True)
    (alone,) = await engine.generate(prompt, params, "tiny-random")
    assert engine.stats["warm_up_seconds"] > 0
    at_start = fns.compiles
    assert at_start == 4  # both functions at batch 1 and at a symbolic batch, without LoRA
    await engine.generate(prompt, params, "tiny-random", n=3)
    assert fns.compiles == at_start
    engine.load_adapter("pol@1", str(random_adapter[0]))
    base, tuned = await asyncio.gather(engine.generate(prompt, params, "tiny-random", n=2),
                                       engine.generate(prompt, params, "pol@1", n=3))
    with_lora = fns.compiles
    assert with_lora == at_start + 8  # the LoRA variants (masked, one slot), when the stacks were first allocated
    (tuned_alone,) = await engine.generate(prompt, params, "pol@1")
    assert fns.compiles == with_lora and fns.failure is None
    for ref, completions in ((model, [alone, *base]), (random_adapter[1], [*tuned, tuned_alone])):
        for c in completions:
            torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced_logprobs(ref, prompt, c.token_ids),
                                       atol=1e-4, rtol=1e-4)
