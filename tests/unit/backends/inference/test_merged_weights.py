"""Decode steps on merged weights (`EngineConfig.merged_single_adapter`, `merged_weights`): a step whose rows all use
one adapter runs the no-LoRA forward on W + (A B)^T; it gives the LoRA path's completions (tiny-random in float32:
same tokens, logprobs within 1e-5), mixed steps keep the LoRA path, and the merged copy follows the slot a step needs
and the adapter in it (a new adapter in the same slot, another slot), rebuilt in place, never under a merged step in
flight (overlapped decode)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from backends.inference.cuda_graphs import DecodeStep
from backends.inference.engine import Engine, EngineConfig, SamplingParams
from tests.unit.backends.inference.test_overlap_decode import PROMPTS, assert_alike, run_all
from tests.unit.backends.inference.test_single_slot import VARIANTS, all_mixed, all_on, place


def make(model, tok, folders: dict, **switches) -> Engine:
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=16, max_loras=2, **switches))
    engine.folders = dict(folders)
    place(engine, "pol@1")
    return engine


@pytest.fixture(scope="module")
def engines(tiny_hf, random_adapter, distinct_adapters):
    """{(variant, merged): engine} of tiny-random with pol@1 in slot 0 and other@1 in slot 1."""
    model, tok = tiny_hf
    folders = {"pol@1": random_adapter[0], "other@1": distinct_adapters[0][0]}
    made = {(variant, merged): make(model, tok, folders, merged_single_adapter=merged, **switches)
            for variant, switches in VARIANTS.items() for merged in (False, True)}
    yield made
    for engine in made.values():
        engine.shutdown()


async def run_counted(engine: Engine, requests, stagger: bool = False) -> tuple[list, dict]:
    """(completions, {stat: increase}) of `requests` (decode_steps, merged_steps, merge_rebuilds)."""
    keys = ("decode_steps", "merged_steps", "merge_rebuilds", "merged_prefills")
    before = {k: engine.stats[k] for k in keys}
    got = await run_all(engine, requests, stagger=stagger)
    return got, {k: engine.stats[k] - before[k] for k in keys}


@pytest.mark.parametrize(("variant", "slot"), [(v, s) for s in (0, 1) for v in VARIANTS])
async def test_one_adapter_batch_equals_lora_path(engines, variant, slot):
    """Every step and prefill merged, at most one rebuild (`place`'s one-token requests may have left the copy on
    pol@1 already: their prefills run merged), none the second time, and the same numbers both times."""
    results = {}
    for merged in (False, True):
        engine = engines[variant, merged]
        place(engine, ["pol@1", "other@1"][slot])  # pol@1 in `slot`
        results[merged], counts = await run_counted(engine, all_on("pol@1"))
        assert counts["decode_steps"] > 0
        assert counts["merged_steps"] == (counts["decode_steps"] if merged else 0)
        assert counts["merge_rebuilds"] <= merged and (counts["merged_prefills"] > 0) == merged
        if merged:
            assert engine.runner.merged.holds(slot) and engine.stats["merge_seconds"] > 0
            again, counts = await run_counted(engine, all_on("pol@1"))
            assert counts["merge_rebuilds"] == 0 and again == results[merged]  # held: no rebuild, same numbers
    for got, want in zip(results[True], results[False]):
        assert_alike(got, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mix", ["two-adapters", "adapter-and-base"])
async def test_mixed_batch_keeps_the_lora_path(engines, variant, mix):
    results = {}
    for merged in (False, True):
        results[merged], counts = await run_counted(engines[variant, merged], all_mixed(mix))
        assert counts["decode_steps"] > 0 and counts["merged_steps"] == 0 and counts["merge_rebuilds"] == 0
    assert results[True] == results[False]


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_switching_slots_rebuilds_and_follows_the_slot(engines, variant):
    """pol@1 (slot 0), other@1 (slot 1), pol@1 again: a rebuild each time; then mixed steps that end on other@1
    alone (short pol@1 and base rows): merged steps after the mixed ones, from a mixed step in flight."""
    tail = [(PROMPTS[0], SamplingParams(max_tokens=6, seed=1, ignore_eos=True), None, 1),
            (PROMPTS[1], SamplingParams(max_tokens=18, seed=2, temperature=0.8, top_p=0.9, ignore_eos=True),
             "other@1", 2),
            (PROMPTS[2], SamplingParams(max_tokens=9, seed=3, ignore_eos=True), "pol@1", 1)]
    results = {}
    for merged in (False, True):
        engine = engines[variant, merged]
        place(engine, "pol@1")
        got = []
        for adapter in ("pol@1", "other@1", "pol@1"):
            completions, counts = await run_counted(engine, all_on(adapter)[:2])
            assert counts["merge_rebuilds"] == int(merged)
            got.append(completions)
        completions, counts = await run_counted(engine, tail)
        if merged:
            assert 0 < counts["merged_steps"] < counts["decode_steps"] and counts["merge_rebuilds"] == 1
            assert engine.runner.merged.holds(1)
        results[merged] = got + [completions]
    for got, want in zip(results[True], results[False]):
        for a, b in zip(got, want):
            assert_alike(a, b)
    assert results[True][0][0][0].token_ids != results[True][1][0][0].token_ids  # the adapters differ


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_a_new_adapter_in_the_same_slot_rebuilds(engines, distinct_adapters, variant):
    """pol@1 reloaded from another adapter's files lands in slot 0 again: the merged copy of the old one is stale,
    and the completions follow the new adapter."""
    results = {}
    for merged in (False, True):
        engine = engines[variant, merged]
        place(engine, "pol@1")
        old, _ = await run_counted(engine, all_on("pol@1"))
        folder, engine.folders["pol@1"] = engine.folders["pol@1"], distinct_adapters[2][0]
        try:
            place(engine, "pol@1")  # unload both, reload: slot 0 gets the new pol@1
            new, counts = await run_counted(engine, all_on("pol@1"))
        finally:
            engine.folders["pol@1"] = folder
            place(engine, "pol@1")
        assert counts["merge_rebuilds"] == int(merged)
        assert [c.token_ids for r in new for c in r] != [c.token_ids for r in old for c in r]
        results[merged] = new
    for got, want in zip(results[True], results[False]):
        assert_alike(got, want)


async def test_no_rebuild_while_a_merged_step_is_in_flight(engines, monkeypatch):
    """Overlapped: the merged copy is made stale by hand between two merged steps (the engine never does that
    itself: a merged step's successor needs the same slot unless an admission, which drains, came between). The
    engine drains the step in flight before rebuilding; the completions are those of the serial LoRA engine."""
    engine = engines["fused-a-overlapped", True]
    place(engine, "pol@1")
    merged = engine.runner.merged
    hold, launch = merged.hold, engine.step.launch
    in_flight_at_rebuild = []

    def watched_hold(slot):
        if not merged.holds(slot):
            step = engine._inflight
            in_flight_at_rebuild.append(step is not None and step.merged)
        return hold(slot)

    def staling_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        if engine.stats["merged_steps"] % 4 == 0:
            merged.held = None
        return launched

    monkeypatch.setattr(merged, "hold", watched_hold)
    monkeypatch.setattr(engine.step, "launch", staling_launch)
    got, counts = await run_counted(engine, all_on("pol@1"))
    assert counts["merge_rebuilds"] >= 3 and in_flight_at_rebuild and not any(in_flight_at_rebuild)
    reference = engines["fused-a", False]
    place(reference, "pol@1")
    want, _ = await run_counted(reference, all_on("pol@1"))
    for a, b in zip(got, want):
        assert_alike(a, b)


async def test_staggered_admissions_overlapped(engines):
    """A second wave (on the other adapter) admitted while the first decodes on merged weights: the admission
    drains, mixed steps follow, then merged steps on the slot that is left."""
    requests = [(PROMPTS[0], SamplingParams(max_tokens=8, seed=1, ignore_eos=True), "pol@1", 2),
                (PROMPTS[1], SamplingParams(max_tokens=6, seed=2, ignore_eos=True), "pol@1", 1),
                (PROMPTS[2], SamplingParams(max_tokens=20, seed=3, ignore_eos=True), "other@1", 1),
                (PROMPTS[3], SamplingParams(max_tokens=22, seed=4, top_logprobs=2, ignore_eos=True), "other@1", 1)]
    results = {}
    for merged in (False, True):
        engine = engines["fused-a-overlapped", merged]
        place(engine, "pol@1")
        results[merged], counts = await run_counted(engine, requests, stagger=True)
        if merged:
            assert counts["merged_steps"] > 0 and counts["merge_rebuilds"] == 2
    for got, want in zip(results[True], results[False]):
        assert_alike(got, want)


def test_buffers_are_the_lora_d_projections(engines):
    """One merged copy of every layer's seven projections, the size of the base ones; allocated once."""
    for variant in VARIANTS:
        runner = engines[variant, True].runner
        base = 0
        for layer in runner.layers:
            for group in layer.groups.values():
                p = group.operands(None)
                base += p.weight.nbytes if p.parts is None else sum(w.nbytes for w, _ in p.parts)
        assert runner.merged.nbytes == base
        assert engines[variant, False].runner.merged is None


async def test_compiled_merged_steps_reuse_the_no_lora_compiles(tiny_hf, random_adapter, distinct_adapters):
    """compile_decode: a merged step runs the functions compiled for no-LoRA steps (same weight shapes), so it
    compiles nothing more; its completions are the eager LoRA path's up to compiled rounding."""
    model, tok = tiny_hf
    folders = {"pol@1": random_adapter[0], "other@1": distinct_adapters[0][0]}
    compiled = make(model, tok, folders, fuse_lora_a=True, compile_decode=True, merged_single_adapter=True)
    reference = make(model, tok, folders, fuse_lora_a=True)
    try:
        fns = compiled.runner.fns
        # a mixed step first: the first decode step after the LoRA stacks are allocated compiles their variants
        warm = SamplingParams(max_tokens=3, seed=0, ignore_eos=True)
        await run_all(compiled, [(PROMPTS[0], warm, "pol@1", 1), (PROMPTS[1], warm, None, 1)], stagger=False)
        before = fns.compiles
        results, counts = {}, {}
        for name, engine in (("compiled", compiled), ("reference", reference)):
            results[name], counts[name] = await run_counted(engine, all_on("pol@1"))
        assert counts["compiled"]["merged_steps"] == counts["compiled"]["decode_steps"] > 0
        assert fns.compiles == before and fns.failure is None
        for got, want in zip(results["compiled"], results["reference"]):
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            for a, b in zip(got, want):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    finally:
        compiled.shutdown()
        reference.shutdown()


async def test_bf16_difference(tiny_hf, random_adapter, distinct_adapters):
    """bf16 (the serving dtype on CUDA): the merged weights round once more than the LoRA path. Prints the largest
    logprob difference over greedy and sampled completions of the same requests (reported, bounded loosely)."""
    model, tok = tiny_hf
    model = copy.deepcopy(model).to(torch.bfloat16)
    folders = {"pol@1": random_adapter[0], "other@1": distinct_adapters[0][0]}
    made = {merged: make(model, tok, folders, fuse_lora_a=True, merged_single_adapter=merged)
            for merged in (False, True)}
    try:
        requests = [(PROMPTS[i], SamplingParams(max_tokens=16, seed=i, temperature=0 if i % 2 else 1.0,
                                                ignore_eos=True), "pol@1", 1) for i in range(6)]
        results = {merged: (await run_counted(engine, requests))[0] for merged, engine in made.items()}
        assert made[True].stats["merged_steps"] > 0
        worst, same_tokens = 0.0, 0
        for got, want in zip(results[True], results[False]):
            a, b = got[0], want[0]
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            same_tokens += n == len(a.token_ids)
            if n:  # up to the first differing token the two runs condition on the same prefix
                worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])))
        print(f"bf16 merged vs LoRA: max logprob diff {worst:.4f}, identical completions {same_tokens}/6")
        assert worst < 0.5
    finally:
        for engine in made.values():
            engine.shutdown()


def test_one_graph_serves_every_slot(engines, monkeypatch):
    """The CUDA-graph keys, with a stand-in capture (records its key, replays nothing): merged steps on slot 0 and
    then slot 1 share one graph, keyed apart from the one-slot LoRA and the no-LoRA graphs, and the rebuild between
    them writes into the same storage (what a captured graph reads)."""
    engine = engines["fused-a", True]  # idle between tests: its thread waits for requests
    step, merged = DecodeStep(engine.runner, 4, engine.max_seq_len, graphs=True), engine.runner.merged
    captured = []

    def capture(key):
        captured.append(key)
        step._graphs[key] = (types.SimpleNamespace(replay=lambda: None), torch.zeros(2, key[0], dtype=torch.float64),
                             torch.zeros(key[0], engine.vocab))
        return step._graphs[key]

    monkeypatch.setattr(step, "_capture", capture)
    storage = [w.data_ptr() for w in merged.tensors()]
    merged.held, rebuilds = None, merged.rebuilds
    with torch.inference_mode():
        for slot, use_merged in ((0, True), (1, True), (0, True), (1, False)):
            step.launch(2, 8, True, False, single_slot=slot, merged=use_merged)
        step.launch(2, 8, False, False)
    assert captured == [(2, 8, False, False, None, True), (2, 8, True, False, 1, False),
                        (2, 8, False, False, None, False)]
    assert merged.rebuilds - rebuilds == 3 and merged.holds(0)
    assert storage == [w.data_ptr() for w in merged.tensors()]
