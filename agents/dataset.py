"""`iterate_dataset`: a script's training batches, the way ART's ``art.utils.iterate_dataset`` yields them.

Rule: the dataset is cut into ``steps_per_epoch = ceil(len(dataset) / groups_per_step)`` batches per epoch (the
last one may be short); epoch ``e`` visits the items in the order ``random.Random(e).shuffle`` gives (ART's order, so
a script moved from ART trains on the same batches), or ``random.Random(f"{seed}/{e}")`` with a ``seed``. Batch
``step = e * steps_per_epoch + epoch_step`` is the training step it feeds, so
``iterate_dataset(..., initial_step=await model.get_step())`` skips the batches a stopped script already trained on
and a resumed (or forked) run continues with the batch the original would have taken next: the data cursor is the
step number, nothing else is stored.

Differences from ART's: the global ``random`` state is left alone (ART reseeds it), a negative ``initial_step`` or a
``groups_per_step`` below 1 is refused, and the progress line (``use_tqdm``) goes to stderr through tqdm only when it
is installed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """One step's items: ``step`` (global, what ``initial_step`` compares with), ``epoch`` and ``epoch_step``."""

    items: list[T] = field(default_factory=list)
    step: int = 0
    epoch: int = 0
    epoch_step: int = 0


def epoch_order(size: int, epoch: int, seed: int | None = None) -> list[int]:
    """The item indices of `epoch` in visiting order (module docstring)."""
    order = list(range(size))
    random.Random(epoch if seed is None else f"{seed}/{epoch}").shuffle(order)
    return order


def iterate_dataset(dataset: Sequence[T], groups_per_step: int = 1, num_epochs: int = 1, initial_step: int = 0,
                    use_tqdm: bool = True, seed: int | None = None) -> Iterator[DatasetBatch[T]]:
    """Yield the batches from `initial_step` on, `groups_per_step` items each, over `num_epochs` epochs."""
    for name, value, least in (("groups_per_step", groups_per_step, 1), ("num_epochs", num_epochs, 0),
                               ("initial_step", initial_step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"iterate_dataset: {name} must be an integer >= {least}, got {value!r}")
    items = list(dataset)
    if not items:
        return
    steps_per_epoch = math.ceil(len(items) / groups_per_step)
    bar = _progress(use_tqdm, initial_step, steps_per_epoch * num_epochs)
    try:
        for epoch in range(initial_step // steps_per_epoch, num_epochs):
            order = epoch_order(len(items), epoch, seed)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                picked = order[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch(items=[items[i] for i in picked], step=step, epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _progress(wanted: bool, initial: int, total: int):
    if not wanted:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(initial=min(initial, total), total=total, desc="Iterating dataset", unit="batch")
