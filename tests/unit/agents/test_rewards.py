"""Composable rewards: weighted components, judge combination modes, the original reward never lost."""

import math

import pytest
from pydantic import ValidationError

from agents import Trajectory
from agents.rewards import (
    RewardComponent,
    RewardConfig,
    apply_judge_scores,
    combine_judge_score,
    combine_rewards,
    set_reward,
)
from tests.fixtures_judge import make_group


def test_float_reward_passes_through_without_component_metrics():
    assert combine_rewards(0.75, None) == (0.75, {})
    assert combine_rewards(2, {}) == (2.0, {})


def test_components_sum_with_weights_and_log_each_component():
    total, metrics = combine_rewards({"correct": 1.0, "format": 0.5, "turns": -0.2}, {"format": 2.0, "turns": 0.5})
    assert total == pytest.approx(1.0 + 2.0 * 0.5 + 0.5 * -0.2)
    assert metrics == {"reward/correct": 1.0, "reward/format": 0.5, "reward/turns": -0.2}


def test_component_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"\['corect'\]"):
        combine_rewards({"correct": 1.0}, {"corect": 2.0})
    with pytest.raises(ValueError, match="'format' must be finite"):
        combine_rewards({"format": math.nan}, None)
    with pytest.raises(ValueError, match="'format' must be a number"):
        combine_rewards({"format": "high"}, None)
    with pytest.raises(ValueError, match="empty"):
        combine_rewards({}, None)
    with pytest.raises(ValueError, match="reward must be finite"):
        combine_rewards(math.inf, None)


def test_reward_config_validates_and_sets_trajectory_reward():
    cfg = RewardConfig(components=[RewardComponent(name="correct", weight=2.0), RewardComponent(name="format", weight=0.0)])
    traj = set_reward(Trajectory(messages_and_choices=[{"role": "user", "content": "x"}]), {"correct": 1.0, "format": 1.0}, cfg)
    assert traj.reward == 2.0 and traj.metrics["reward/format"] == 1.0
    with pytest.raises(ValidationError, match="more than once"):
        RewardConfig(components=[RewardComponent(name="a"), RewardComponent(name="a")])
    with pytest.raises(ValidationError, match=r"\[0, 1\]"):
        RewardConfig(mode="weighted", judge_weight=1.5)
    with pytest.raises(ValidationError, match="component name"):
        RewardComponent(name="bad name")
    with pytest.raises(ValidationError):
        RewardConfig(mode="multiply")


@pytest.mark.parametrize(
    "mode, weight, expected",
    [("replace", 1.0, [0.2, 0.9]), ("add", 0.5, [1.0 + 0.1, 3.0 + 0.45]), ("weighted", 0.25, [0.75 * 1.0 + 0.05, 0.75 * 3.0 + 0.225])],
)
def test_apply_judge_scores_modes_keep_the_original(mode, weight, expected):
    group = make_group(["4", "5"], rewards=[1.0, 3.0])
    scored = apply_judge_scores(group, {1: 0.9, 0: 0.2}, mode, weight)
    assert scored.rewards == pytest.approx(expected)
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [1.0, 3.0]
    assert [t.metrics["judge_score"] for t in scored.trajectories] == [0.2, 0.9]
    assert group.rewards == [1.0, 3.0] and "judge_score" not in group.trajectories[0].metrics  # input untouched


def test_rescoring_combines_with_the_original_not_the_previous_judge_result():
    group = make_group(["4", "5"], rewards=[1.0, 3.0])
    once = apply_judge_scores(group, [0.5, 0.5], "add", 1.0)
    twice = apply_judge_scores(once, [0.5, 0.5], "add", 1.0)
    assert twice.rewards == once.rewards == [1.5, 3.5]
    assert [t.metrics["independent_reward"] for t in twice.trajectories] == [1.0, 3.0]


def test_apply_judge_scores_rejects_bad_score_sets():
    group = make_group(["4", "5"])
    with pytest.raises(ValueError, match=r"missing \[1\], unknown \[2\]"):
        apply_judge_scores(group, {0: 0.1, 2: 0.3})
    with pytest.raises(ValueError, match="got 3 judge scores for a group of 2"):
        apply_judge_scores(group, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="trajectory 1 must be finite"):
        apply_judge_scores(group, [0.1, math.nan])
    with pytest.raises(ValueError, match="unknown reward combination mode"):
        combine_judge_score(0.0, 1.0, "max")  # type: ignore[arg-type]
