"""iterate_dataset: ART's batches, deterministic, resumable from any step (agents/dataset.py)."""

from __future__ import annotations

import random

import pytest

from agents.dataset import iterate_dataset

DATA = [f"item-{i}" for i in range(10)]


def _batches(**kwargs):
    return [(b.step, b.epoch, b.epoch_step, b.items) for b in iterate_dataset(DATA, use_tqdm=False, **kwargs)]


def test_epochs_cover_every_item_once_in_arts_order():
    batches = _batches(groups_per_step=4, num_epochs=2)
    assert [b[:3] for b in batches] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1), (5, 1, 2)]
    assert [len(b[3]) for b in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (0, 1):
        visited = [item for b in batches if b[1] == epoch for item in b[3]]
        order = list(range(len(DATA)))
        random.seed(epoch)  # ART's rule: the global generator seeded with the epoch
        random.shuffle(order)
        assert visited == [DATA[i] for i in order]


def test_resuming_at_a_step_continues_where_the_run_stopped():
    full = _batches(groups_per_step=3, num_epochs=3)
    for start in range(len(full) + 1):
        assert _batches(groups_per_step=3, num_epochs=3, initial_step=start) == full[start:]
    assert _batches(groups_per_step=3, num_epochs=3, initial_step=99) == []


def test_deterministic_by_seed_and_leaves_the_global_generator_alone():
    random.seed(123)
    before = random.random()
    random.seed(123)
    a = _batches(groups_per_step=5, seed=7)
    assert random.random() == before
    assert a == _batches(groups_per_step=5, seed=7)
    assert a != _batches(groups_per_step=5, seed=8)
    assert sorted(i for b in a for i in b[3]) == sorted(DATA)


@pytest.mark.parametrize("kwargs, name", [({"groups_per_step": 0}, "groups_per_step"),
                                          ({"initial_step": -1}, "initial_step"),
                                          ({"num_epochs": 1.5}, "num_epochs")])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"iterate_dataset: {name} must be an integer"):
        list(iterate_dataset(DATA, use_tqdm=False, **kwargs))


def test_empty_dataset_yields_nothing():
    assert list(iterate_dataset([], groups_per_step=2, use_tqdm=False)) == []
