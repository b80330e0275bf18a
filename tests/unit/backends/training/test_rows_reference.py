"""``history_rows`` (each token checked once, by C loops where all is well) builds exactly the rows of the
straightforward algorithm below, which checks every turn's whole prompt token by token, and stops with the same error
for the same bad input."""

import math
import random
import struct

import numpy as np
import pytest

from agents.trajectory import SampledTurn
from backends.training import token_rows
from backends.training.token_rows import TrainingRow, build_rows, history_rows
from benchmarks.training import synthetic_groups
from tests.fixtures_trainer import synthetic_turn


def reference_history_rows(items, where="history"):
    """The per-token row building: every turn's whole prompt checked, then the extension rule."""
    turns = [(k, item) for k, item in enumerate(items) if isinstance(item, SampledTurn)]
    rows, current = [], None
    for k, item in [(k, item) for k, item in turns if item.trainable]:
        at = f"{where}, turn {k}"
        for name, ids in (("prompt_token_ids", item.prompt_token_ids), ("token_ids", item.token_ids)):
            bad = next((t for t in ids if not isinstance(t, int) or t < 0), None)
            if bad is not None:
                raise ValueError(f"{at}: {name} holds {bad!r}, not a token id")
        for i, lp in enumerate(item.logprobs):
            if not math.isfinite(lp):
                raise ValueError(f"{at}: sampler logprob of sampled token {i} is {lp} (must be finite)")
        prompt = item.prompt_token_ids
        if current is not None and len(prompt) >= len(current) and prompt[: len(current)] == current.token_ids:
            between = prompt[len(current):]
        else:
            current = TrainingRow([], [], [], source=at)
            rows.append(current)
            between = prompt
        current.token_ids += between
        current.loss_mask += [False] * len(between)
        current.sampler_logprobs += [0.0] * len(between)
        current.token_ids += item.token_ids
        current.loss_mask += [True] * len(item.token_ids)
        current.sampler_logprobs += [float(x) for x in item.logprobs]
    return rows, sum(not item.trainable for _, item in turns)


def _conversation(rng: random.Random, turns: int) -> list:
    """Turns whose prompts mostly extend the conversation so far, sometimes rewrite it or drop it."""
    items, ctx = [{"role": "user", "content": "q"}], [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
    for _ in range(turns):
        comp = [rng.randrange(1000) for _ in range(rng.randint(1, 10))]
        items.append(synthetic_turn(list(ctx), comp, logprob=rng.choice([-0.0, -0.5, -1e-30])))
        ctx = ctx + comp + [rng.randrange(1000) for _ in range(rng.randint(0, 10))]
        if rng.random() < 0.2:
            ctx[rng.randrange(len(ctx))] += 1  # the template rewrote history
        if rng.random() < 0.1:
            ctx = ctx[: rng.randint(1, len(ctx))]  # a shorter prompt
        if rng.random() < 0.1:
            items.append(SampledTurn(message={"role": "assistant", "content": "x"}, prompt_token_ids=list(ctx),
                                     token_ids=[1], logprobs=[]))  # untrainable
    return items


def _same_rows(items):
    want_rows, want_n = reference_history_rows(items, "h")
    got_rows, got_n = history_rows(items, "h")
    assert got_n == want_n
    assert [(r.token_ids, r.loss_mask, r.source) for r in got_rows] == [
        (r.token_ids, r.loss_mask, r.source) for r in want_rows]
    for g, w in zip(got_rows, want_rows):  # logprobs bit for bit (-0.0 is not 0.0 here), and Python floats
        assert [struct.pack("<d", x) for x in g.sampler_logprobs] == [struct.pack("<d", x) for x in w.sampler_logprobs]
        assert all(type(x) is float for x in g.sampler_logprobs)


@pytest.mark.parametrize("seed", range(8))
def test_rows_equal_the_per_token_building(seed):
    rng = random.Random(seed)
    _same_rows(_conversation(rng, rng.randint(1, 12)))


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_build_rows_equal_the_per_token_building(monkeypatch, overlong):
    groups = synthetic_groups(0, vocab=1000, step_tokens=6000, min_len=64, max_len=512)
    got, got_stats = build_rows(groups, max_row_tokens=400, overlong=overlong)
    monkeypatch.setattr(token_rows, "history_rows", reference_history_rows)
    want, want_stats = build_rows(groups, max_row_tokens=400, overlong=overlong)
    assert got_stats == want_stats and got_stats.rows > 4
    assert [vars(r) for r in got] == [vars(r) for r in want]


def _bad_turn(prompt, completion, logprobs=None):
    """A turn past validation (a corrupt file, an object edited after it was made)."""
    return SampledTurn.model_construct(message={"role": "assistant", "content": "x"}, prompt_token_ids=prompt,
                                       token_ids=completion, logprobs=logprobs or [-1.0] * len(completion))


@pytest.mark.parametrize("bad", [
    [_bad_turn([1, -2, 3], [4])],  # negative id in a fresh prompt
    [synthetic_turn([1, 2], [3]), _bad_turn([1, 2, 3, -4, 5], [6])],  # in the part the row does not hold yet
    [synthetic_turn([1, 2], [3]), _bad_turn([1, -2, 3, 4], [6])],  # in a prompt that rewrote the row
    [synthetic_turn([1, 2], [3]), _bad_turn([1, 2, 3], [6, -1])],  # in the completion
    [_bad_turn([1, "x", 3], [4])],
    [_bad_turn([1, 2], [4, 2.5])],
    [_bad_turn([1, 2], [4, 5.0])],
    [_bad_turn([1, np.int64(2)], [4])],
    [synthetic_turn([1, 2], [3]), _bad_turn([1, 2, 3, np.int64(9)], [4])],
    [_bad_turn([1, 2], [4, 5], [-1.0, float("nan")])],
    [synthetic_turn([1, 2], [3]), _bad_turn([1, 2, 3], [4, 5, 6], [-1.0, float("-inf"), float("inf")])],
    [_bad_turn([-1], [-2], [float("nan")])],  # several faults: the first one checked is named
])
def test_bad_turns_are_the_same_error(bad):
    with pytest.raises(Exception) as want:
        reference_history_rows(bad, "h")
    with pytest.raises(Exception) as got:
        history_rows(bad, "h")
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize("bad, message", [
    ([_bad_turn([1, None, 3], [4])], "h, turn 0: prompt_token_ids holds None, not a token id"),
    ([synthetic_turn([1, 2], [3]), _bad_turn([1, 2, 3], [None])], "h, turn 1: token_ids holds None, not a token id"),
])
def test_a_none_token_id_is_named(bad, message):
    """The per-token building let None through (it was its own 'nothing bad found'); it is an error like any other
    non-id."""
    with pytest.raises(ValueError) as got:
        history_rows(bad, "h")
    assert str(got.value) == message


def test_good_unusual_inputs_are_accepted_as_before():
    # bools are ints to both; a huge id is an int (the vocabulary check, not this one, rejects it)
    _same_rows([_bad_turn([1, True, 2**70], [False, 3])])
    # logprobs whose sum overflows are still finite; integer logprobs become floats
    _same_rows([_bad_turn([1, 2], [3, 4], [-1e308, -1e308]), _bad_turn([1, 2, 3, 4, 5], [6, 7], [-1, 0])])
