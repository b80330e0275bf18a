"""Training rows from the exact tokens the sampler saw and produced; the chat is never re-rendered.

A row is one token sequence the trainer runs forward, with a loss mask and the sampler's logprobs:

- Each trainable SampledTurn (prompt ids, sampled ids and one logprob per sampled id) contributes
  ``prompt_token_ids`` and ``token_ids``. Only the sampled ids are trained (mask 1); everything else,
  the prompt, tool results, environment text, the template between turns, is context (mask 0).
- Consecutive turns of one history share a row only when the next turn's ``prompt_token_ids`` starts
  with the whole row so far (prompt + completion, token for token, the "extension property"); the
  tokens it adds (tool results, the next turn's template) are masked. Otherwise a new row starts, so a
  template that rewrites history (drops old reasoning, re-tokenises) never trains on tokens the model
  did not actually see.
- Each of a trajectory's ``additional_histories`` makes its own rows with the trajectory's advantage.
- Turns without prompt ids, token ids or matching logprobs are not trainable: counted and skipped (their
  tokens can still sit, masked, inside a later turn's prompt).
- Trajectories with ``error`` set are left out before advantages are computed; groups whose rewards
  are all equal contribute nothing; trajectories whose advantage is exactly 0 carry no gradient and
  are left out too. All of these are counted.
- Rows longer than ``max_row_tokens`` are dropped or truncated (``overlong``); a truncated row that
  keeps no sampled token is dropped. Counted either way.
- A non-finite reward or sampler logprob, or a negative token id, is an error naming the trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup
from backends.training.advantages import group_advantages


@dataclass
class TrainingRow:
    """One sequence to train on. ``sampler_logprobs[i]`` is the behaviour logprob of ``token_ids[i]``
    where ``loss_mask[i]`` is True, and 0.0 elsewhere."""

    token_ids: list[int]
    loss_mask: list[bool]
    sampler_logprobs: list[float]
    advantage: float = 0.0
    trajectory: int = 0  # index of its trajectory among the step's trained trajectories
    source: str = ""  # where it came from, for error messages
    weight: float = 0.0  # aggregation weight of each trained token (losses.assign_aggregation_weights)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RowStats:
    """What row building kept and left out (all reported as step metrics)."""

    groups: int = 0
    skipped_groups: int = 0  # all rewards equal (or fewer than 2 usable trajectories)
    failed_rollouts: int = 0  # exceptions recorded in groups instead of trajectories
    errored_trajectories: int = 0  # trajectory.error set
    zero_advantage_trajectories: int = 0
    trajectories: int = 0  # trajectories that contribute at least one trained token
    untrainable_turns: int = 0  # sampled turns without prompt ids / token ids / logprobs
    rows: int = 0
    dropped_rows: int = 0  # overlong (drop) or nothing left after truncation
    truncated_rows: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def _first_bad_index(ids: Sequence[Any]) -> int | None:
    """Where the first element of ``ids`` that is not a token id (an ``int`` >= 0) is, or None (an index, so that a
    None among the ids is found too).

    The common all-good case is answered by two C loops: ``sum`` stays an ``int`` only over ints (a float, a numpy
    integer or a Decimal makes it that type; a str or None raises) and ``min`` finds a negative. Any doubt runs the
    element-by-element check, which names the culprit; a Python loop over every token cost ~3x more."""
    try:
        if not ids or (type(sum(ids)) is int and min(ids) >= 0):
            return None
    except TypeError:
        pass
    return next((i for i, t in enumerate(ids) if not isinstance(t, int) or t < 0), None)


def _check_turn(turn: SampledTurn, new_prompt: Sequence[Any], where: str) -> None:
    """``new_prompt``: the part of the turn's prompt the row does not hold yet. The rest compared equal, token by
    token, to the row's tokens, checked when the row took them (the row keeps those), so a conversation is checked
    once, not once per turn; what this lets through is a non-int number equal to an id (5.0, numpy's 5) in that part."""
    for name, ids in (("prompt_token_ids", new_prompt), ("token_ids", turn.token_ids)):
        bad = _first_bad_index(ids)
        if bad is not None:
            raise ValueError(f"{where}: {name} holds {ids[bad]!r}, not a token id")
    try:  # a NaN or an infinity makes the sum non-finite; so may an overflow, which the loop then clears
        finite = math.isfinite(sum(turn.logprobs))
    except TypeError:
        finite = False
    if not finite:
        for i, lp in enumerate(turn.logprobs):
            if not math.isfinite(lp):
                raise ValueError(f"{where}: sampler logprob of sampled token {i} is {lp} (must be finite)")


def history_rows(items: Iterable[Any], where: str = "history") -> tuple[list[TrainingRow], int]:
    """Rows of one conversation by the extension rule; returns (rows, untrainable sampled turns)."""
    rows: list[TrainingRow] = []
    current: TrainingRow | None = None
    untrainable = 0
    for k, item in enumerate(items):
        if not isinstance(item, SampledTurn):
            continue
        if not item.trainable:
            untrainable += 1
            continue
        prompt = item.prompt_token_ids
        extends = current is not None and len(prompt) >= len(current) and prompt[: len(current)] == current.token_ids
        between = prompt[len(current):] if extends else prompt
        _check_turn(item, between, f"{where}, turn {k}")
        if not extends:
            current = TrainingRow([], [], [], source=f"{where}, turn {k}")
            rows.append(current)
        current.token_ids += between
        current.loss_mask += [False] * len(between)
        current.sampler_logprobs += [0.0] * len(between)
        current.token_ids += item.token_ids
        current.loss_mask += [True] * len(item.token_ids)
        current.sampler_logprobs += map(float, item.logprobs)
    return rows, untrainable


def _fit(row: TrainingRow, max_tokens: int, overlong: str, stats: RowStats) -> TrainingRow | None:
    if len(row) <= max_tokens:
        return row
    if overlong == "drop":
        stats.dropped_rows += 1
        return None
    row.token_ids = row.token_ids[:max_tokens]
    row.loss_mask = row.loss_mask[:max_tokens]
    row.sampler_logprobs = row.sampler_logprobs[:max_tokens]
    if not any(row.loss_mask):
        stats.dropped_rows += 1
        return None
    stats.truncated_rows += 1
    return row


def _group_name(gi: int, group: TrajectoryGroup) -> str:
    return f"group {gi}" + (f" (scenario {group.scenario_id})" if group.scenario_id else "")


def trajectory_rows(traj: Trajectory, where: str) -> tuple[list[TrainingRow], int]:
    """Rows of a trajectory's main conversation, then of each additional history."""
    rows, untrainable = history_rows(traj.messages_and_choices, where)
    for hi, hist in enumerate(traj.additional_histories):
        more, n = history_rows(hist.messages_and_choices, f"{where}, additional history {hi}")
        rows += more
        untrainable += n
    return rows, untrainable


def build_rows(
    groups: Sequence[TrajectoryGroup],
    *,
    max_row_tokens: int,
    overlong: str = "drop",
    scale_rewards: bool = True,
) -> tuple[list[TrainingRow], RowStats]:
    """All training rows of a step, each carrying its trajectory's advantage, plus the counts."""
    stats = RowStats(groups=len(groups))
    rows: list[TrainingRow] = []
    for gi, group in enumerate(groups):
        gname = _group_name(gi, group)
        stats.failed_rollouts += len(group.exceptions)
        usable: list[tuple[int, Trajectory]] = []
        for ti, traj in enumerate(group.trajectories):
            if not math.isfinite(float(traj.reward)):
                raise ValueError(f"{gname}, trajectory {ti}: reward is {traj.reward} (must be finite)")
            if traj.error is not None:
                stats.errored_trajectories += 1
                continue
            usable.append((ti, traj))
        advantages = group_advantages([t.reward for _, t in usable], scale=scale_rewards)
        if advantages is None:
            stats.skipped_groups += 1
            continue
        for (ti, traj), adv in zip(usable, advantages):
            where = f"{gname}, trajectory {ti}"
            traj_rows, untrainable = trajectory_rows(traj, where)
            stats.untrainable_turns += untrainable
            if adv == 0.0:
                stats.zero_advantage_trajectories += 1
                continue
            kept = [r for r in (_fit(r, max_row_tokens, overlong, stats) for r in traj_rows) if r is not None]
            if not kept:
                continue
            for r in kept:
                r.advantage = adv
                r.trajectory = stats.trajectories
            stats.trajectories += 1
            rows += kept
    stats.rows = len(rows)
    return rows, stats
