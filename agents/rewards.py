"""Composable rewards: weighted components, and how a judge's score combines with the agent's own reward.

An agent's reward is a float, or named components ``{"correct": 1.0, "format": 0.5}``. Components
combine as a weighted sum, ``total = sum_i w_i * r_i`` (a component without a weight counts with
weight 1), and each component is logged as its own metric ``reward/<name>`` (unweighted).

A judge score ``j`` in [0, 1] then combines with the agent's own total ``r`` by mode:

- ``replace``:  ``reward = j``                      (RULER's behaviour; ``r`` only kept as a metric)
- ``add``:      ``reward = r + judge_weight * j``
- ``weighted``: ``reward = (1 - judge_weight) * r + judge_weight * j``   (``judge_weight`` in [0, 1])

Whatever the mode, the agent's own reward stays in ``metrics["independent_reward"]`` next to
``metrics["judge_score"]``; re-applying a judge combines with that original value, never with a
previous judge result, so scoring a group twice gives the same rewards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agents.trajectory import Trajectory, TrajectoryGroup

CombineMode = Literal["replace", "add", "weighted"]

INDEPENDENT_REWARD = "independent_reward"
JUDGE_SCORE = "judge_score"
COMPONENT_PREFIX = "reward/"


class RewardComponent(BaseModel):
    """One named part of an agent's reward and its weight in the sum."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="component name as the agent's reward dict spells it; logged as `reward/<name>`")
    weight: float = Field(default=1.0, description="multiplier in the weighted sum; 0 logs the component without training on it")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not v or len(v) > 100 or any(c.isspace() for c in v) or "/" in v:
            raise ValueError(f"reward component name must be 1-100 chars without spaces or '/': {v!r}")
        return v

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward component weight must be finite, got {v!r}")
        return v


class RewardConfig(BaseModel):
    """How an agent's reward is assembled: component weights, and how a judge score combines with it."""

    model_config = ConfigDict(extra="forbid")

    components: list[RewardComponent] = Field(
        default_factory=list,
        description="weights of the named components the agent's reward returns; empty = plain sum of whatever it returns",
    )
    mode: CombineMode = Field(
        default="replace",
        description="how a judge score `j` combines with the agent's own reward `r`: `replace` (`j`; pure RULER), "
        "`add` (`r + judge_weight*j`; keeps a hard signal), `weighted` (`(1-judge_weight)*r + judge_weight*j`)",
    )
    judge_weight: float = Field(
        default=1.0,
        description="weight of the judge score in add/weighted modes; in weighted mode it must lie in [0, 1]",
    )

    @field_validator("judge_weight")
    @classmethod
    def _finite_weight(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"judge_weight must be finite, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        names = [c.name for c in self.components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward components named more than once: {dupes}")
        if self.mode == "weighted" and not 0.0 <= self.judge_weight <= 1.0:
            raise ValueError(f"judge_weight must be in [0, 1] in weighted mode, got {self.judge_weight}")
        return self

    def weights(self) -> dict[str, float] | None:
        """Component weights by name, or None when no components are configured."""
        return {c.name: c.weight for c in self.components} or None

    def combine(self, own: float | Mapping[str, float]) -> tuple[float, dict[str, float]]:
        """:func:`combine_rewards` with this config's weights."""
        return combine_rewards(own, self.weights())


def _finite_number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return value


def combine_rewards(
    own: float | Mapping[str, float], weights: Mapping[str, float] | None = None
) -> tuple[float, dict[str, float]]:
    """Total reward and per-component metrics: ``sum_i w_i * r_i`` with ``w_i`` = 1 unless weighted.

    A float passes through with no extra metrics. A dict yields ``{"reward/<name>": r_i}`` for every
    component. A weight naming a component the reward did not return is an error (a typo would
    otherwise silently drop that part of the reward).
    """
    if not isinstance(own, Mapping):
        return _finite_number(own, "reward"), {}
    if not own:
        raise ValueError("reward components are empty: return at least one named component or a float")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise ValueError(f"reward weights name components the reward did not return: {unknown} (returned: {sorted(own)})")
    total = 0.0
    metrics: dict[str, float] = {}
    for name in sorted(own):
        value = _finite_number(own[name], f"reward component {name!r}")
        weight = _finite_number(weights.get(name, 1.0), f"weight of reward component {name!r}")
        total += weight * value
        metrics[f"{COMPONENT_PREFIX}{name}"] = value
    return total, metrics


def set_reward(trajectory: Trajectory, own: float | Mapping[str, float], config: RewardConfig | None = None) -> Trajectory:
    """Write an agent's reward (float or components) into the trajectory, components as metrics."""
    total, metrics = (config or RewardConfig()).combine(own)
    trajectory.reward = total
    trajectory.metrics.update(metrics)
    return trajectory


def combine_judge_score(own: float, judge: float, mode: CombineMode = "replace", judge_weight: float = 1.0) -> float:
    """The formula of the module docstring for one trajectory."""
    if mode == "replace":
        return judge
    if mode == "add":
        return own + judge_weight * judge
    if mode == "weighted":
        if not 0.0 <= judge_weight <= 1.0:
            raise ValueError(f"judge_weight must be in [0, 1] in weighted mode, got {judge_weight}")
        return (1.0 - judge_weight) * own + judge_weight * judge
    raise ValueError(f"unknown reward combination mode {mode!r}: use replace, add or weighted")


def original_reward(trajectory: Trajectory) -> float:
    """The agent's own reward: kept in ``independent_reward`` once a judge has touched the trajectory."""
    kept = trajectory.metrics.get(INDEPENDENT_REWARD)
    return float(kept) if kept is not None else trajectory.reward


def _normalize_scores(scores: Mapping[int, float] | Sequence[float], n: int) -> list[float]:
    if isinstance(scores, Mapping):
        keys = set(scores)
        bad = sorted(k for k in keys if isinstance(k, bool) or not isinstance(k, int))
        if bad:
            raise ValueError(f"judge scores must be keyed by trajectory index (int), got keys {bad!r}")
        missing = sorted(set(range(n)) - keys)
        extra = sorted(keys - set(range(n)))
        if missing or extra:
            raise ValueError(f"judge scores must cover trajectories 0..{n - 1}: missing {missing}, unknown {extra}")
        values = [scores[i] for i in range(n)]
    else:
        values = list(scores)
        if len(values) != n:
            raise ValueError(f"got {len(values)} judge scores for a group of {n} trajectories")
    return [_finite_number(v, f"judge score of trajectory {i}") for i, v in enumerate(values)]


def apply_judge_scores(
    group: TrajectoryGroup,
    scores: Mapping[int, float] | Sequence[float],
    mode: CombineMode = "replace",
    judge_weight: float = 1.0,
) -> TrajectoryGroup:
    """A copy of the group whose rewards combine the judge's scores (by trajectory index) per ``mode``.

    Sets ``metrics["judge_score"]`` and keeps the agent's own reward in ``metrics["independent_reward"]``
    (set once, never overwritten). The input group is not modified.
    """
    values = _normalize_scores(scores, len(group.trajectories))
    trajectories = []
    for traj, judge in zip(group.trajectories, values):
        own = original_reward(traj)
        metrics = {**traj.metrics, INDEPENDENT_REWARD: own, JUDGE_SCORE: judge}
        new = traj.model_copy(update={"metrics": metrics, "logs": list(traj.logs)})
        new.reward = combine_judge_score(own, judge, mode, judge_weight)
        trajectories.append(new)
    return group.model_copy(
        update={"trajectories": trajectories, "metrics": dict(group.metrics), "logs": list(group.logs)}
    )
