"""One LoRA slot per decode step (`EngineConfig.single_slot_lora`, `lora_slots` "One slot"): a step whose rows all
use one adapter reads only that slot's columns, without row masks or select, and gives the completions of the masked
path; a mixed step (two adapters, or adapter and base rows) takes the masked path.

Exactness: on the CPU the masked path's eager step reads the columns of slots < the highest slot in use + 1. With the
adapter in slot 0 that is slot 0's columns only: the one-slot GEMMs have the very same operands and shapes, so the
numbers are identical. With the adapter in slot 1 the masked GEMMs sum over both slots' columns (slot 0's zeroed by
the select) where the one-slot ones sum over slot 1's alone: other shapes, other blocking, float rounding only
(tokens equal, logprobs within 1e-5).
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.inference.engine import Engine, EngineConfig, SamplingParams
from tests.unit.backends.inference.test_overlap_decode import PROMPTS, assert_alike, run_all

# the CPU default (A a matmul of its own, members separate), A fused into the base GEMM, and that overlapped (a
# sequence that ends at step t has a discarded row in step t+1)
VARIANTS = {"separate": dict(fuse_lora_a=False), "fused-a": dict(fuse_lora_a=True),
            "fused-a-overlapped": dict(fuse_lora_a=True, overlap_decode=True)}


@pytest.fixture(scope="module")
def engines(tiny_hf, random_adapter, distinct_adapters):
    """{(variant, single_slot_lora): engine} of tiny-random with pol@1 and other@1 (2 LoRA slots)."""
    model, tok = tiny_hf
    made = {}
    for variant, switches in VARIANTS.items():
        for single in (False, True):
            engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=16, max_loras=2,
                                                                     single_slot_lora=single, **switches))
            engine.folders = {"pol@1": random_adapter[0], "other@1": distinct_adapters[0][0]}
            place(engine, "pol@1")
            made[variant, single] = engine
    yield made
    for engine in made.values():
        engine.shutdown()


def place(engine: Engine, first: str) -> None:
    """(Re)load pol@1 and other@1 with `first` in slot 0 and the other in slot 1 (each placed by a one-token
    request into the free slot with the lowest index)."""
    order = [first, *(n for n in engine.folders if n != first)]
    uids = []
    for name in order:
        if name in engine.adapters.names():
            engine.unload_adapter(name)
    deadline = time.monotonic() + 30
    while engine.lora.resident():  # the engine thread frees the slots
        assert time.monotonic() < deadline, "the unloaded adapters' slots were not freed"
        time.sleep(0.01)
    engine.lora._used[:] = [0] * len(engine.lora._used)  # no slot less recently used than another: lowest index
    for name in order:
        uids.append(engine.load_adapter(name, str(engine.folders[name])).uid)
        engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=1, seed=0), name, timeout=60)
    assert engine.lora._uid == uids


async def run_counted(engine: Engine, requests) -> tuple[list, int, int]:
    """(completions, decode steps, one-slot steps) of `requests` submitted in one admission."""
    steps, single = engine.stats["decode_steps"], engine.stats["single_slot_steps"]
    got = await run_all(engine, requests, stagger=False)
    return got, engine.stats["decode_steps"] - steps, engine.stats["single_slot_steps"] - single


def all_mixed(mix: str) -> list:
    """Requests of equal lengths, so that every step is mixed: pol@1 rows with other@1 or base rows."""
    second = "other@1" if mix == "two-adapters" else None
    long = SamplingParams(max_tokens=12, seed=1, ignore_eos=True)
    return [(PROMPTS[0], long, "pol@1", 2), (PROMPTS[1], long, second, 1), (PROMPTS[2], long, "pol@1", 1)]


def all_on(adapter: str) -> list:
    return [(PROMPTS[i], SamplingParams(max_tokens=10 + 2 * i, seed=i, temperature=0.9, top_logprobs=2,
                                        ignore_eos=True), adapter, 1 + i % 2) for i in range(4)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("slot", [0, 1])
async def test_one_adapter_batch_equals_masked_path(engines, variant, slot):
    results = {}
    for single in (False, True):
        engine = engines[variant, single]
        place(engine, "pol@1" if slot == 0 else "other@1")
        results[single], steps, one_slot = await run_counted(engine, all_on("pol@1"))
        assert steps > 0 and one_slot == (steps if single else 0)
    if slot == 0:  # the same GEMM operands as the eager masked path (module docstring): the same numbers
        assert results[True] == results[False]
    else:
        for got, want in zip(results[True], results[False]):
            assert_alike(got, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mix", ["two-adapters", "adapter-and-base"])
async def test_mixed_batch_takes_the_masked_path(engines, variant, mix):
    requests = all_mixed(mix)
    results = {}
    for single in (False, True):
        results[single], steps, one_slot = await run_counted(engines[variant, single], requests)
        assert steps > 0 and one_slot == 0
    assert results[True] == results[False]


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_switching_between_one_slot_and_mixed_steps(engines, variant):
    """Base and other@1 rows end early, pol@1 rows run on alone: mixed steps first, then one-slot steps. The base
    row stops on a token (an unforeseen stop: overlapped, its row in the next step is computed and discarded)."""
    requests = [(PROMPTS[0], SamplingParams(max_tokens=24, seed=1, ignore_eos=True), None, 1),
                (PROMPTS[1], SamplingParams(max_tokens=20, seed=2, temperature=0.8, top_p=0.9, ignore_eos=True),
                 "pol@1", 2),
                (PROMPTS[2], SamplingParams(max_tokens=9, seed=3, ignore_eos=True), "other@1", 1),
                (PROMPTS[3], SamplingParams(max_tokens=14, seed=4, top_logprobs=3, ignore_eos=True), "pol@1", 1)]
    (probe,) = (await run_all(engines[variant, False], requests[:1], stagger=False))[0]
    requests[0][1].stop_token_ids = [probe.token_ids[4]]  # where this seed's tokens go, the base row stops
    results = {}
    for single in (False, True):
        results[single], steps, one_slot = await run_counted(engines[variant, single], requests)
        if single:
            assert 0 < one_slot < steps
    for got, want in zip(results[True], results[False]):
        assert_alike(got, want)
    assert results[True][0][0].finish_reason == "stop" and len(results[True][0][0].token_ids) <= 5
    assert [len(c.token_ids) for r in results[True][1:] for c in r] == [20, 20, 9, 14]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched that are not views: each launches a kernel on the device (a few, such as a
    ``to`` of a tensor already of that dtype, launch none)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_slot_step_has_no_selects(engines, variant):
    """The same decode step (4 rows on slot 1) through `DecodeStep._body`, masked and one-slot: the one-slot step has
    no masked_fill_ for LoRA (the one left is the attention bias) and no row-mask comparisons (``ne``)."""
    engine = engines[variant, True]
    step, layers = engine.step, len(engine.runner.layers)
    host = step.host.numpy()
    host[:] = 0
    host[0, :4], host[1, :4], host[2, :4], host[3, :4], host[4, :4] = [5, 6, 7, 8], 3, 1, 1.0, 1.0
    step.dev.copy_(step.host)
    counts, outs = {}, {}
    with torch.inference_mode():
        for single in (None, 1):
            with OpCounter() as counter:
                outs[single] = step._body(4, 8, True, False, single, 2)[0].clone()
            counts[single] = counter.ops
    masked, one = counts[None], counts[1]
    # all that goes: a select per group and layer, a row mask per member count (1, 2, 3); nothing comes instead
    assert masked - one == {"masked_fill_": 4 * layers, "ne": 3} and not one - masked
    assert one["masked_fill_"] == 1  # the attention bias's
    assert torch.equal(outs[None][0], outs[1][0])  # same tokens
    torch.testing.assert_close(outs[None][1], outs[1][1], atol=1e-5, rtol=0)
    print(f"{variant}: ops per step masked {sum(masked.values())}, one slot {sum(one.values())}; "
          f"masked_fill_ {masked['masked_fill_']} -> {one['masked_fill_']}, {layers} layers")



@pytest.mark.parametrize(("requests", "slot"), [(all_on("pol@1")[:1], 0), (all_mixed("two-adapters"), None)],
                         ids=["one-adapter", "mixed"])
async def test_a_one_adapter_prefill_reads_its_slot_alone(engines, monkeypatch, requests, slot):
    """Prefill takes the one-slot path too (its rows' LoRA terms without per-row masks); a mixed prefill keeps them.
    Same completions either way: the engines without one-slot steps give the masked path's."""
    engine = engines["separate", True]
    seen, real = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda *a: seen.append(a[5]) or real(*a))
    place(engine, "pol@1")
    seen.clear()
    got = await run_all(engine, requests, stagger=False)
    assert seen == [slot]
    want = await run_all(engines["separate", False], requests, stagger=False)
    for g, w in zip(got, want):
        assert_alike(g, w)
