"""The Agent protocol: what a user implements so trajflow can train it.

An agent owns its scenarios (by split and seed), a rollout that talks to an OpenAI-compatible
endpoint under a given policy name and returns a :class:`Trajectory`, and its reward. The reward
may be set inside the rollout (the ART way; :meth:`BaseAgent.reward` then returns it unchanged) or
computed afterwards by overriding ``reward``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from openai import AsyncOpenAI
from pydantic import BaseModel

from agents.scenario import Scenario, Split
from agents.trajectory import Trajectory


@runtime_checkable
class Agent(Protocol):
    name: str

    def scenarios(self, split: Split, seed: int) -> list[Scenario]:
        """All scenarios of a split, in an order fixed by ``seed``."""
        ...

    async def rollout(self, client: AsyncOpenAI, policy: str, scenario: Scenario) -> Trajectory:
        """Play one episode against ``policy`` (the model name to pass to the client)."""
        ...

    def reward(self, scenario: Scenario, trajectory: Trajectory) -> float | dict[str, float]:
        """The reward of a finished trajectory: a float, or named components (summed unless weighted)."""
        ...


class BaseAgent:
    """Convenience base: ``reward`` returns what the rollout stored in ``trajectory.reward``."""

    name: str = "agent"
    system_prompt: str = ""

    def scenarios(self, split: Split, seed: int) -> list[Scenario]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def rollout(self, client: AsyncOpenAI, policy: str, scenario: Scenario) -> Trajectory:  # pragma: no cover
        raise NotImplementedError

    def reward(self, scenario: Scenario, trajectory: Trajectory) -> float | dict[str, float]:
        return trajectory.reward

    def config(self) -> dict[str, Any]:
        """Agent settings recorded with the run."""
        return {"name": self.name}


class ConfiguredAgent(BaseAgent):
    """An agent whose options are a pydantic model: ``Agent(config)`` or ``Agent(**options)``, not both.

    A misspelt option fails validation naming it; :meth:`config` records the settings with the run.
    """

    config_class: ClassVar[type[BaseModel]]

    def __init__(self, config: BaseModel | None = None, **options: Any):
        if config is not None and options:
            raise ValueError(f"pass either a {self.config_class.__name__} or keyword options, not both")
        self.settings = config or self.config_class(**options)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self.settings.model_dump()}
