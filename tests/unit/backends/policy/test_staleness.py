"""The pipeline's schedule and the trainer's staleness bound (backends/policy/staleness.py)."""

from __future__ import annotations

import pytest

from agents.trajectory import Trajectory, TrajectoryGroup
from backends.policy.checkpoints import train_step
from backends.policy.staleness import StaleGroupError, check_staleness, sampled_by, sampling_step
from storage.layout import SCORED
from storage.store import RunStore


def group(policy_step: int | None, scenario: str = "s", policy: str | None = None) -> TrajectoryGroup:
    return TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1.0)],
                           scenario_id=scenario, policy_step=policy_step,
                           metadata={"policy": policy} if policy else {})


def test_schedule_samples_with_the_stalest_policy_the_bound_allows():
    assert [sampling_step(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]  # the synchronous loop
    assert [sampling_step(s, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampling_step(s, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]
    for k in range(4):
        for s in range(1, 9):
            assert 0 <= s - 1 - sampling_step(s, k) <= k  # every scheduled group is inside the bound


def test_metrics_over_groups_inside_the_bound():
    metrics = check_staleness([group(4), group(3), group(3)], step=5, max_off_policy_steps=1)
    assert metrics == {"pipeline/staleness_mean": pytest.approx(2 / 3), "pipeline/staleness_max": 1.0,
                       "pipeline/stale_groups": 2.0}
    assert check_staleness([group(4)], step=5, max_off_policy_steps=0)["pipeline/staleness_max"] == 0.0


def test_a_group_staler_than_the_bound_is_refused_naming_it_and_the_field():
    with pytest.raises(StaleGroupError) as err:
        check_staleness([group(4), group(2, scenario="q-7")], step=5, max_off_policy_steps=1)
    message = str(err.value)
    assert "step 5 cannot train on group 1 (scenario 'q-7')" in message
    assert "sampled by policy step 2, 2 steps stale, more than pipeline.max_off_policy_steps=1 allows" in message
    with pytest.raises(StaleGroupError, match="policy step 5, newer than the policy it trains"):
        check_staleness([group(5)], step=5, max_off_policy_steps=3)


def test_without_a_bound_staleness_is_only_measured():
    assert check_staleness([group(0)], step=5, max_off_policy_steps=None)["pipeline/staleness_max"] == 4.0


def test_groups_stored_before_the_field_give_their_step_through_the_policy_name():
    old = group(None, policy="tiny@3")
    assert sampled_by(old) == 3 and sampled_by(group(None, policy="tiny")) is None and sampled_by(group(None)) is None
    with pytest.raises(StaleGroupError):
        check_staleness([old], step=6, max_off_policy_steps=1)
    assert check_staleness([group(None), group(None, policy="base")], step=6, max_off_policy_steps=0) == {}


def test_train_step_refuses_before_storing_or_training(tmp_path):
    """The refusal comes before scored.parquet is written and before the trainer is touched (an object without
    train_step: reaching it would raise AttributeError instead)."""
    store = RunStore(str(tmp_path), "p", "r")
    with pytest.raises(StaleGroupError):
        train_step(store, 3, object(), groups=[group(0)], max_off_policy_steps=1)
    assert not store.exists(3, SCORED)
