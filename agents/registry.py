"""Agent lookup by name: the built-in example agents, or ``"module:attr"`` for your own.

``get_agent("arithmetic", max_operand=9)`` builds the example agent with those options (validated by
its pydantic config: a misspelt option is an error naming it). ``get_agent("my_pkg.agents:MyAgent")``
imports ``my_pkg.agents`` and uses ``MyAgent``: a class or factory is called with the options, an
instance is used as is (options are then refused). The result must satisfy the :class:`Agent` protocol.
"""

from __future__ import annotations

import importlib
from typing import Any

from agents.agent import Agent

BUILTIN: dict[str, str] = {
    "arithmetic": "agents.examples.arithmetic:ArithmeticAgent",
    "tictactoe": "agents.examples.tictactoe:TicTacToeAgent",
    "research": "agents.examples.research:ResearchAgent",
}


def _load(target: str, name: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent {name!r}: expected 'module:attr', e.g. 'my_pkg.agents:MyAgent'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"agent {name!r}: cannot import module {module_name!r} ({exc})") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"agent {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def get_agent(name: str, **options: Any) -> Agent:
    """The agent called ``name`` (a built-in name or ``module:attr``), built with ``options``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"agent name must be a non-empty string, got {name!r}")
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown agent {name!r}: use one of {sorted(BUILTIN)} or 'module:attr'")
    obj = _load(target, name)
    if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Agent)):
        agent = obj(**options)
    elif options:
        raise ValueError(f"agent {name!r} is an instance; it takes no options (got {sorted(options)})")
    else:
        agent = obj
    if not isinstance(agent, Agent):
        missing = [a for a in ("name", "scenarios", "rollout", "reward") if not hasattr(agent, a)]
        raise TypeError(f"agent {name!r} is a {type(agent).__name__} without {', '.join(missing)} "
                        "(see agents.agent.Agent)")
    return agent
