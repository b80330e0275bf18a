"""LoRA slots in the engine: a reused slot serves the adapter now in it; one row's adapter never reaches another row.

Each adapter is checked against its own peft model (teacher-forced logprobs), so a slot that kept any of the
previous adapter's weights, columns or modules would show up as a mismatch.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from backends.inference.adapters import AdapterError, HostAdapter
from backends.inference.engine import Engine, EngineConfig, SamplingParams
from backends.inference.lora_slots import GROUPS
from tests.unit.backends.serving.test_server import MESSAGES, teacher_forced_logprobs

PARAMS = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)


def _prompt(tok) -> list[int]:
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


# (fuse_projections, fuse_lora_a, compile_decode): the CPU default, the CUDA defaults, A in the base GEMM, and that
# compiled (Inductor's C++ backend here; the rank grows 2 -> 4 -> 8 -> 16 in these tests, reallocating the weights)
VARIANTS = {"separate": (False, False, False), "fused": (True, False, False), "fused-a": (False, True, False),
            "fused-a-compiled": (False, True, True)}


@pytest.fixture(params=list(VARIANTS))
def two_slot_engine(request, tiny_hf):
    model, tok = tiny_hf
    fuse, fuse_a, compiled = VARIANTS[request.param]
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=8, max_loras=2, fuse_projections=fuse,
                                                             fuse_lora_a=fuse_a, compile_decode=compiled))
    yield engine
    engine.shutdown()


def _assert_matches(reference_model, prompt, completion):
    expected = teacher_forced_logprobs(reference_model, prompt, completion.token_ids)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)


async def test_reused_slots_serve_each_adapter_exactly(two_slot_engine, tiny_hf, distinct_adapters):
    engine, prompt = two_slot_engine, _prompt(tiny_hf[1])
    names = [f"a{i}@1" for i in range(len(distinct_adapters))]
    for name, (folder, _) in zip(names, distinct_adapters):
        engine.load_adapter(name, str(folder))
    # one at a time, then the first ones again: with two slots every request after the second reuses a slot
    order = list(range(len(names))) + [0, 3, 1]
    for i in order:
        (completion,) = await engine.generate(prompt, PARAMS, names[i])
        _assert_matches(distinct_adapters[i][1], prompt, completion)
    assert len(engine.lora.resident()) == 2
    assert engine.runner.fns.failure is None  # the compiled variant ran compiled, not its eager fallback
    # in pairs, so a batch mixes two adapters whose slots were just reused
    for i, j in ((4, 2), (1, 0), (3, 2)):
        (a,), (b,) = await asyncio.gather(engine.generate(prompt, PARAMS, names[i]),
                                          engine.generate(prompt, PARAMS, names[j]))
        _assert_matches(distinct_adapters[i][1], prompt, a)
        _assert_matches(distinct_adapters[j][1], prompt, b)


def _poison_slot(engine: Engine, uid: int, parts: str) -> None:
    """Write NaN over the A (and/or B) columns of the slot holding adapter `uid`: what a non-finite adapter that got
    past the load check would leave there."""
    slots = engine.lora
    slot, R = slots._uid.index(uid), slots.rank
    with torch.inference_mode():  # the stacks were allocated by the engine thread, in inference mode
        for layer in range(slots.num_layers):
            for group, members in GROUPS.items():
                cols = slice(slot * len(members) * R, (slot + 1) * len(members) * R)
                if "A" in parts:
                    slots.A[layer][group][:, cols] = float("nan")
                if "B" in parts:
                    slots.B[layer][group][cols] = float("nan")


@pytest.mark.parametrize("parts", ["A"])
async def test_a_non_finite_slot_never_reaches_other_rows(two_slot_engine, tiny_hf, random_adapter,
                                                          distinct_adapters, parts):
    """NaN in a slot's A reaches no other row. NaN in its B would reach every row of the batch (``h @ B`` sums over
    all slots' rows of B, with zeros in h): the slot refuses such weights at load, test_a_slot_refuses_non_finite_
    weights; one GEMM per group instead of a masked delta and an add is what that check buys."""
    engine, prompt = two_slot_engine, _prompt(tiny_hf[1])
    engine.load_adapter("good@1", str(random_adapter[0]))
    bad = engine.load_adapter("bad@1", str(distinct_adapters[0][0]))
    (base_alone,) = await engine.generate(prompt, PARAMS, "tiny-random")
    await engine.generate(prompt, PARAMS, "bad@1")  # places it in a slot, where it stays (the engine is idle now)
    _poison_slot(engine, bad.uid, parts)
    # the bad request is admitted first and runs longer, so every step of the others shares its batch
    long = SamplingParams(max_tokens=30, seed=1, ignore_eos=True)
    (poisoned,), (base,), (good,) = await asyncio.gather(
        engine.generate(prompt, long, "bad@1"), engine.generate(prompt, PARAMS, "tiny-random"),
        engine.generate(prompt, PARAMS, "good@1"))
    assert not torch.isfinite(torch.tensor(poisoned.logprobs)).all()  # the poison is live in that batch
    assert base.token_ids == base_alone.token_ids
    torch.testing.assert_close(torch.tensor(base.logprobs), torch.tensor(base_alone.logprobs))
    _assert_matches(random_adapter[1], prompt, good)


@pytest.mark.parametrize("two_slot_engine", ["separate"], indirect=True)
def test_a_slot_refuses_non_finite_weights(two_slot_engine):
    slots = two_slot_engine.lora
    fan_in, fan_out = slots.layout["q_proj"]
    a = torch.zeros(4, fan_in)
    b = torch.zeros(fan_out, 4)
    b[0, 0] = 1e30  # finite in float32, but not once scaled
    host = HostAdapter(rank=4, scale=1e10, weights={(0, "q_proj"): (a, b)})
    with pytest.raises(AdapterError, match="not finite"):
        slots.acquire(999, lambda: host)
    assert 999 not in slots.resident()
