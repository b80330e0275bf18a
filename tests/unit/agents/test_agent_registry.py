"""get_agent: built-in names, 'module:attr' for user agents, and clear errors for everything else."""

from __future__ import annotations

import importlib

import pytest

from agents import Agent, BaseAgent
from agents.registry import BUILTIN, get_agent


class MyAgent(BaseAgent):
    name = "mine"

    def __init__(self, size: int = 1):
        self.size = size

    def scenarios(self, split, seed):
        return []

    async def rollout(self, client, policy, scenario):
        raise NotImplementedError


MY_INSTANCE = MyAgent(size=7)
NOT_AN_AGENT = {"name": "dict"}


def make_agent(**options):
    return MyAgent(**options)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_names(name):
    module_name, _, attr = BUILTIN[name].partition(":")
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError:
        pytest.skip(f"{module_name} not written yet")
    agent = get_agent(name)
    assert isinstance(agent, Agent) and agent.name == name
    assert type(agent).__name__ == attr
    assert agent.scenarios("val", seed=0), f"{name} has no val scenarios"


def test_options_reach_the_builtin_agent():
    assert get_agent("arithmetic", max_operand=5).settings.max_operand == 5


def test_user_agents_by_module_attr():
    assert get_agent("tests.unit.agents.test_agent_registry:MyAgent", size=3).size == 3
    assert get_agent("tests.unit.agents.test_agent_registry:make_agent", size=4).size == 4
    assert get_agent("tests.unit.agents.test_agent_registry:MY_INSTANCE") is MY_INSTANCE


@pytest.mark.parametrize("name, options, error, match", [
    ("arithmetc", {}, ValueError, r"unknown agent 'arithmetc': use one of \['arithmetic', 'research', 'tictactoe'\]"),
    ("", {}, ValueError, "non-empty string"),
    ("no_such_pkg.mod:Agent", {}, ValueError, "cannot import module 'no_such_pkg.mod'"),
    ("tests.unit.agents.test_agent_registry:Missing", {}, ValueError, "has no attribute 'Missing'"),
    ("tests.unit.agents.test_agent_registry:", {}, ValueError, "expected 'module:attr'"),
    ("tests.unit.agents.test_agent_registry:MY_INSTANCE", {"size": 2}, ValueError, r"is an instance; it takes no options"),
    ("tests.unit.agents.test_agent_registry:NOT_AN_AGENT", {}, TypeError, "is a dict without name, scenarios, rollout, reward"),
    ("tests.unit.agents.test_agent_registry:MyAgent", {"colour": 1}, TypeError, "colour"),
])
def test_bad_names_and_options(name, options, error, match):
    with pytest.raises(error, match=match):
        get_agent(name, **options)
