"""Shared prefill (`prompt_sharing`): requests admitted together with the same prompt and adapter get one prefill
row, and each keeps its own sampling: the completions are those of the same requests prefilled one row each, and of
each request alone (tokens equal; logprobs up to the float rounding that other batch shapes give on the CPU). A
request admitted while a sequence holding its row runs reuses that row without a forward. Different adapters or
prompts never share a row, and aborting the request whose row was shared leaves the others' copies of its KV prefix
intact. Serial and overlapped decode (whose steps also write the rows of finished, not yet freed slots)."""

from __future__ import annotations

import asyncio

import pytest

from backends.inference import engine as engine_module
from backends.inference.engine import Engine, EngineConfig, SamplingParams
from backends.inference.prompt_sharing import LivePrompts, SharedRows, one_row_each, share_rows
from tests.fixtures_server import wait_until
from tests.unit.backends.inference.test_overlap_decode import PROMPTS, assert_alike, run_all


def test_rows_are_shared_by_equal_prompts_on_one_adapter_only():
    prompts = [[5, 6, 7], [5, 6, 7], [5, 6, 7, 8], [5, 6, 7], [5, 6], [5, 6, 7], [5, 6, 7, 8]]
    adapters = [-1, -1, -1, 0, -1, 1, -1]
    keys = [(-1, (5, 6, 7)), (-1, (5, 6, 7, 8)), (0, (5, 6, 7)), (-1, (5, 6)), (1, (5, 6, 7))]
    assert share_rows(prompts, adapters) == SharedRows([0, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4, 1], keys)
    assert share_rows([], []) == SharedRows([], [], [])
    assert one_row_each(prompts, adapters) == SharedRows(list(range(7)), list(range(7)), [None] * 7)
    with pytest.raises(ValueError):
        share_rows(prompts, adapters[:-1])


def test_a_live_row_goes_with_its_last_holder():
    live, key, other = LivePrompts(), (-1, (5, 6)), (0, (5, 6))
    a, b, c = object(), object(), object()
    live.hold(key, "logits", [a, b])
    live.hold(key, "ignored: the row is live", [c])
    live.hold(other, "other logits", [object()])
    assert live.find(key) == ("logits", a) and len(live) == 2
    live.release(a)
    live.release(object())  # never held anything
    assert live.find(key) == ("logits", b)
    live.release(b)
    live.release(c)
    assert live.find(key) is None and len(live) == 1


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def engine(request, tiny_hf, random_adapter, distinct_adapters):
    """tiny-random serving pol@1 and other@1 (2 LoRA slots), decoding serially or overlapped."""
    model, tok = tiny_hf
    engine = Engine(model, tok, "tiny-random", EngineConfig(max_batch_size=32, max_loras=2,
                                                           overlap_decode=request.param))
    engine.load_adapter("pol@1", str(random_adapter[0]))
    engine.load_adapter("other@1", str(distinct_adapters[0][0]))
    yield engine
    engine.shutdown()


@pytest.fixture
def prefills(engine, monkeypatch) -> list[tuple[int, list[int]]]:
    """(rows, slots) of every prefill the engine runs from now on."""
    seen: list[tuple[int, list[int]]] = []
    prefill = engine.runner.prefill

    def counted(tokens, lengths, slots, *args, **kwargs):
        seen.append((tokens.shape[0], slots.tolist()))
        return prefill(tokens, lengths, slots, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "prefill", counted)
    return seen


def grpo_groups() -> list:
    """Two groups of one prompt each (pol@1, base) and a request of its own: different seeds, temperatures, top-p,
    greedy rows, top logprobs, n > 1 for a group's first request and for a later one, and two identical requests."""
    def params(seed, **kw):
        return SamplingParams(max_tokens=kw.pop("max_tokens", 12), seed=seed, ignore_eos=True, **kw)

    on_policy = [(PROMPTS[3], params(1), "pol@1", 2), (PROMPTS[3], params(2), "pol@1", 1),
                 (PROMPTS[3], params(3, temperature=0.7, top_p=0.9, top_logprobs=2), "pol@1", 1),
                 (PROMPTS[3], params(4, temperature=0, top_logprobs=3, max_tokens=8), "pol@1", 1),
                 (PROMPTS[3], params(5), "pol@1", 1), (PROMPTS[3], params(5), "pol@1", 1)]
    base = [(PROMPTS[1], params(6), None, 1), (PROMPTS[1], params(7, top_p=0.5), None, 3),
            (PROMPTS[1], params(8, max_tokens=5), None, 1)]
    return on_policy + base + [(PROMPTS[5], params(9), "pol@1", 1)]


async def alone(engine: Engine, requests) -> list:
    """The completions of each request submitted by itself, one after the other."""
    return [await engine.generate(p, s, m, n) for p, s, m, n in requests]


def counters(engine: Engine) -> dict[str, int]:
    return {k: engine.stats[k] for k in ("prefills", "prefill_tokens", "shared_prefill_requests")}


def delta(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in counters(engine).items()}


async def test_one_row_per_prompt_gives_the_completions_of_one_row_per_request(engine, prefills, monkeypatch):
    requests = grpo_groups()
    before = counters(engine)
    shared = await run_all(engine, requests, stagger=False)
    assert [rows for rows, _ in prefills] == [3]
    assert delta(engine, before) == {"prefills": 1, "shared_prefill_requests": len(requests) - 3,
                                     "prefill_tokens": len(PROMPTS[3]) + len(PROMPTS[1]) + len(PROMPTS[5])}

    monkeypatch.setattr(engine_module, "share_rows", one_row_each)
    unshared = await run_all(engine, requests, stagger=False)
    assert [rows for rows, _ in prefills] == [3, len(requests)]
    # the same decode steps; only the prefill's batch differs (3 rows against 10)
    for got, want in zip(shared, unshared):
        assert_alike(got, want)
    for got, want in zip(shared, await alone(engine, requests)):
        assert_alike(got, want)

    flat = [c for r in shared for c in r]
    assert all(len(c.token_ids) == s.max_tokens for (_, s, _, _), r in zip(requests, shared) for c in r)
    assert len({tuple(c.token_ids) for c in flat}) == len(flat) - 1  # own seeds, own tokens: but for the twins
    assert shared[4] == shared[5]
    assert shared[2][0].top_logprobs and len(shared[2][0].top_logprobs) == 12


async def test_other_adapters_and_other_prompts_get_rows_of_their_own(engine, prefills):
    params = SamplingParams(max_tokens=10, seed=21, ignore_eos=True)
    prompt = PROMPTS[3]
    requests = [(prompt, params, "pol@1", 1), (prompt, params, None, 1), (prompt, params, "other@1", 1),
                (prompt + [9], params, "pol@1", 1), (prompt[:-1], params, "pol@1", 1),
                (prompt, params, "pol@1", 1)]
    before = counters(engine)
    got = await run_all(engine, requests, stagger=False)
    assert [rows for rows, _ in prefills] == [5]
    assert delta(engine, before)["shared_prefill_requests"] == 1
    for a, b in zip(got, await alone(engine, requests)):
        assert_alike(a, b)
    assert got[0] == got[-1]
    # one seed, one uniform per token: only what the row computes (adapter, prompt) separates these
    assert len({tuple(r[0].token_ids) for r in got[:5]}) == 5


async def test_aborting_the_request_whose_row_was_shared_leaves_the_others_alone(engine, prefills):
    kept = [SamplingParams(max_tokens=200, seed=30 + i, ignore_eos=True) for i in range(3)]
    reference = await alone(engine, [(PROMPTS[3], p, "pol@1", 1) for p in kept])
    prefills.clear()
    before = counters(engine)
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    with engine._cv:  # one admission, the doomed request first: its slot holds the row
        doomed = asyncio.ensure_future(engine.generate(PROMPTS[3], long, "pol@1"))
        jobs = [asyncio.ensure_future(engine.generate(PROMPTS[3], p, "pol@1")) for p in kept]
        await asyncio.sleep(0)
    steps = engine.stats["decode_steps"]
    await wait_until(lambda: engine.stats["decode_steps"] > steps + 3, 30, "a few decode steps")
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    # another prompt takes the freed slot (the lowest free one) and prefills over its keys and values
    await engine.generate(PROMPTS[5], SamplingParams(max_tokens=2, seed=3))
    assert not any(job.done() for job in jobs), "the group finished before its row's slot was reused"
    (rows, slots), (_, reused) = prefills
    assert rows == 1 and reused == slots[:1]
    assert delta(engine, before)["shared_prefill_requests"] == len(kept)
    for got, want in zip(await asyncio.wait_for(asyncio.gather(*jobs), 120), reference):
        assert_alike(got, want)


async def decoding(engine: Engine, job: asyncio.Future) -> None:
    """Wait until `job`'s request has had a few decode steps."""
    steps = engine.stats["decode_steps"]
    await wait_until(lambda: engine.stats["decode_steps"] > steps + 3, 30, "a few decode steps")
    assert not job.done()


async def test_a_request_admitted_later_reuses_the_row_a_running_sequence_holds(engine, prefills):
    prompt, later = PROMPTS[3], [SamplingParams(max_tokens=12, seed=40 + i, ignore_eos=True) for i in range(3)]
    requests = [(prompt, p, "pol@1", n) for p, n in zip(later, (1, 2, 1))] + [(prompt, later[0], None, 1)]
    reference = await alone(engine, requests)
    await wait_until(lambda: len(engine.live_prompts) == 0, 10, "the finished requests' rows to go")
    prefills.clear()
    before = counters(engine)
    first = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True), "pol@1"))
    await decoding(engine, first)
    got = await asyncio.gather(*[engine.generate(p, s, m, n) for p, s, m, n in requests])
    # pol@1's requests took the row (one admission or several), the base one computed its own
    assert [rows for rows, _ in prefills] == [1, 1]
    assert delta(engine, before)["shared_prefill_requests"] == 3
    for a, b in zip(got, reference):
        assert_alike(a, b)
    await first
    await wait_until(lambda: len(engine.live_prompts) == 0, 10, "the rows to go with their last holders")
    await engine.generate(prompt, later[0], "pol@1")
    assert len(prefills) == 3  # nobody held the row any more: computed again


async def test_the_row_outlives_its_first_holder(engine, prefills):
    prompt = PROMPTS[5]
    params = [SamplingParams(max_tokens=m, seed=50 + m, ignore_eos=True) for m in (300, 20)]
    reference = await alone(engine, [(prompt, params[1], "other@1", 1)])
    prefills.clear()
    before = counters(engine)
    doomed = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=500, ignore_eos=True),
                                                   "other@1"))
    await decoding(engine, doomed)
    second = asyncio.ensure_future(engine.generate(prompt, params[0], "other@1"))  # copies the doomed one's prefix
    await decoding(engine, second)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    # the row now lives in the second request's slot alone; the freed slot is the lowest, so this one takes it
    got = await engine.generate(prompt, params[1], "other@1")
    assert not second.done() and len(prefills) == 1
    assert delta(engine, before)["shared_prefill_requests"] == 2
    assert_alike(got, reference[0])
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
