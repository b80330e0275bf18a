"""The agent author's world: scenarios, trajectories, groups, the Agent protocol and ART's script API.

`import agents as art` gives ART's names: TrainableModel, Model, TrainConfig, TrainResult, Trajectory,
TrajectoryGroup, gather_trajectory_groups, iterate_dataset (ART's art.utils.iterate_dataset) and the judge,
ruler_score_group.
"""

from agents.agent import Agent, BaseAgent
from agents.dataset import DatasetBatch, iterate_dataset
from agents.gather import GatherError, gather_trajectories, gather_trajectory_groups
from agents.model import Model, TrainableModel, TrainConfig, TrainResult
from agents.scenario import Scenario, Split
from agents.trajectory import Conversation, History, RecordedException, SampledTurn, Trajectory, TrajectoryGroup

__all__ = [
    "Agent",
    "BaseAgent",
    "Conversation",
    "DatasetBatch",
    "GatherError",
    "History",
    "Model",
    "RecordedException",
    "SampledTurn",
    "Scenario",
    "Split",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "ruler_score_group",
]


def __getattr__(name):
    if name == "ruler_score_group":
        from agents.judge import ruler_score_group

        return ruler_score_group
    raise AttributeError(name)
