"""`gather_trajectory_groups`: run many groups of rollouts concurrently, the ART way.

Every group's awaitables run at once; exceptions are recorded in their group. ``max_exceptions`` is a
count, or a fraction of all rollouts when strictly between 0 and 1; past it ``GatherError`` is raised
listing the first errors. ``after_each(group)`` runs as each group finishes (where a judge such as
``ruler_score_group`` plugs in) and may return the group, a replacement, a list of groups, or None to
drop it. A progress line on stderr shows finished rollouts and the running mean reward.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from agents.trajectory import RecordedException, Trajectory, TrajectoryGroup


class GatherError(RuntimeError):
    """More rollouts raised than ``max_exceptions`` allows."""


class _ProgressBar:
    """A one-line progress display: done/total, mean reward, exceptions, elapsed time."""

    def __init__(self, desc: str | None, total: int, stream=None):
        self.desc, self.total, self.stream = desc or "gather", total, stream or sys.stderr
        self.done = 0
        self.rewards: list[float] = []
        self.errors = 0
        self.started = time.perf_counter()
        self._last = 0.0

    def update(self, traj: Trajectory | None, exc: BaseException | None) -> None:
        self.done += 1
        if traj is not None:
            self.rewards.append(traj.reward)
        if exc is not None:
            self.errors += 1
        now = time.perf_counter()
        if now - self._last > 0.5 or self.done == self.total:
            self._last = now
            mean = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r{self.desc}: {self.done}/{self.total} reward={mean:.3f} "
                              f"exceptions={self.errors} [{now - self.started:.1f}s]{end}")
            self.stream.flush()


def _limit(max_exceptions: int | float, total: int) -> float:
    if 0 < max_exceptions < 1:
        return max_exceptions * total
    return float(max_exceptions)


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: Callable[[TrajectoryGroup], Any] | None = None,
) -> list[TrajectoryGroup]:
    """Await all groups concurrently and return them in input order (see module docstring)."""
    groups = list(groups)
    total = sum(g.pending + len(g.trajectories) if isinstance(g, TrajectoryGroup) else 1 for g in groups)
    bar = _ProgressBar(pbar_desc, total) if pbar_desc else None

    async def finish(g: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        if isinstance(g, TrajectoryGroup):
            group = await g.gather(on_done=bar.update if bar else None)
        else:
            group = await g
        if after_each is None:
            return [group]
        result = after_each(group)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        return list(result) if isinstance(result, list) else [result]

    results = await asyncio.gather(*(finish(g) for g in groups))
    out = [g for chunk in results for g in chunk]
    errors: list[RecordedException] = [e for g in out for e in g.exceptions]
    if len(errors) > _limit(max_exceptions, total):
        first = "\n".join(f"- {e.type}: {e.message}" for e in errors[:5])
        raise GatherError(f"{len(errors)} of {total} rollouts raised (max_exceptions={max_exceptions}):\n{first}")
    return out


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]], *, pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[Trajectory]:
    """Flat variant: one implicit group; returns the trajectories that succeeded."""
    groups = await gather_trajectory_groups([TrajectoryGroup(trajectories)], pbar_desc=pbar_desc,
                                            max_exceptions=max_exceptions)
    return [t for g in groups for t in g.trajectories]
