"""ART's backend.train keywords -> TrainConfig (backends/art/train_options.py), and model.log's inputs."""

from __future__ import annotations

import pytest

from agents.model import TrainConfig, as_groups
from agents.trajectory import Trajectory, TrajectoryGroup
from backends.art.train_options import ART_ONLY, train_config


def test_arts_keywords_map_to_the_trainer_settings():
    assert train_config() == TrainConfig()
    cfg = train_config(learning_rate=2e-5, loss_fn="ppo", kl_penalty_coef=0.1, epsilon=0.2, epsilon_high=0.3,
                       truncated_importance_sampling=2.0, normalize_advantages=False, verbose=True)
    assert cfg == TrainConfig(learning_rate=2e-5, loss="ppo", kl_coef=0.1, epsilon=0.2, epsilon_high=0.3,
                              tis_cap=2.0, scale_rewards=False)
    assert train_config(**ART_ONLY) == TrainConfig()  # every other keyword of ART's at its default is accepted


def test_what_trajflow_does_not_do_is_refused_by_name():
    with pytest.raises(ValueError, match="precalculate_logprobs=True is not supported"):
        train_config(precalculate_logprobs=True)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' is not supported"):
        train_config(importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="save_checkpoint=False"):
        train_config(save_checkpoint=False)
    with pytest.raises(ValueError, match="loss_fn must be one of cispo, ppo, gspo, got 'grpo'"):
        train_config(loss_fn="grpo")
    with pytest.raises(ValueError, match="contradicts"):
        train_config(normalize_advantages=False, scale_rewards=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr'"):
        train_config(lr=1e-5)
    with pytest.raises(ValueError, match="greater than 0"):
        train_config(learning_rate=0)


def test_model_log_takes_groups_trajectories_and_their_exceptions():
    a, b = Trajectory(reward=1.0), Trajectory(reward=0.0)
    groups = [TrajectoryGroup([a]), TrajectoryGroup([b])]
    assert as_groups(groups) == groups
    (one,) = as_groups([a, RuntimeError("tool exploded"), b])
    assert one.trajectories == [a, b] and one.exceptions[0].message == "tool exploded"
    assert as_groups(None) == []
    with pytest.raises(TypeError, match="not a mix"):
        as_groups([a, groups[0]])
    with pytest.raises(TypeError, match="got dict"):
        as_groups([{"reward": 1.0}])


def test_a_steps_options_last_for_that_step_only():
    """Each step trains with the registered settings plus its own call's options: a resumed process, which starts
    from the registered settings, trains exactly as the one that stopped."""
    from backends.art.local_backend import step_settings
    from backends.training.config import TrainerConfig

    registered = TrainerConfig(learning_rate=1e-4, loss="ppo")
    tuned = step_settings(registered, train_config(learning_rate=2e-5, kl_penalty_coef=0.1))
    assert (tuned["learning_rate"], tuned["loss"], tuned["kl_coef"]) == (2e-5, "ppo", 0.1)
    plain = step_settings(registered, train_config())
    assert (plain["learning_rate"], plain["loss"], plain["kl_coef"]) == (1e-4, "ppo", 0.0)
