"""The agent author's world: scenarios, trajectories, groups and the Agent protocol."""

from .agent import Agent, BaseAgent
from .scenario import Scenario, Split
from .trajectory import Conversation, History, RecordedException, SampledTurn, Trajectory, TrajectoryGroup

__all__ = [
    "Agent",
    "BaseAgent",
    "Conversation",
    "History",
    "RecordedException",
    "SampledTurn",
    "Scenario",
    "Split",
    "Trajectory",
    "TrajectoryGroup",
]
