"""Demonstrations: the scripted experts' conversations on train scenarios, as OpenAI chat-format JSONL for SFT.

One line per conversation: ``{"messages": [...], "tools": [...], "metadata": {...}}``. ``messages`` are what the
agent's own ``rollout`` recorded while playing against the expert (:mod:`agents.examples.scripted_policy`): its
system prompt and user turns, the expert's assistant turns (tool calls with ``content`` null), and the results of
the agent's real tools. ``tools`` is the agent's tool schemas (absent for an agent without tools); ``metadata`` says
where the line came from (agent, split, scenario id, seed) and the reward the agent gives it.

The rules:

1. Train split only. A demonstration of a val or test scenario would train on the problems the curve is measured
   on, so any other split is refused, and the research expert is given only the train questions.
2. Every line is scored again from its stored messages with the agent's own ``reward(scenario, trajectory)``; a line
   below the expert's floor (research 1.0: right answer, no malformed call; tic-tac-toe the draw reward: never a loss
   or an illegal move) stops the generation with an error naming the scenario, so an expert bug never becomes data.
3. Deterministic: the same agent, count and seed give the same bytes (scenarios in ``agent.scenarios("train",
   seed)`` order, the first ``count``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.agent import Agent
from agents.examples.research_expert import ResearchExpert
from agents.examples.scripted_policy import ScriptedPolicy
from agents.examples.tictactoe_expert import TicTacToeExpert
from agents.registry import get_agent
from agents.rewards import combine_rewards
from agents.scenario import Scenario
from agents.trajectory import Trajectory

DEMO_SPLIT = "train"


class DemoError(ValueError):
    """A demonstration request that cannot be met: the message says which input is wrong."""


@dataclass(frozen=True)
class Expert:
    """How to build an agent's expert (from the agent, its train scenarios and the seed) and its reward floor."""

    build: Callable[[Any, list[Scenario], int], Any]
    floor: Callable[[Any], float]


EXPERTS: dict[str, Expert] = {
    "research": Expert(build=lambda agent, train, seed: ResearchExpert(agent, train), floor=lambda agent: 1.0),
    "tictactoe": Expert(build=lambda agent, train, seed: TicTacToeExpert(seed),
                        floor=lambda agent: agent.settings.draw_reward),
}


def check_request(agent_name: str, split: str, count: int | None) -> None:
    """Refuse what cannot be demonstrated, before anything runs."""
    if agent_name not in EXPERTS:
        raise DemoError(f"no scripted expert for agent {agent_name!r}: demonstrations exist for "
                        f"{', '.join(sorted(EXPERTS))}")
    if split != DEMO_SPLIT:
        raise DemoError(f"split {split!r}: demonstrations come from the train split only (val and test must stay "
                        "unseen by training)")
    if count is not None and count < 1:
        raise DemoError(f"count must be at least 1, got {count}")


def record(agent: Agent, scenario: Scenario, traj: Trajectory, seed: int) -> dict[str, Any]:
    """One JSONL line: the conversation with ``content`` explicit on every message, tools, provenance."""
    messages = [{"content": None, **m} if m.get("role") == "assistant" else dict(m) for m in traj.messages()]
    out: dict[str, Any] = {"messages": [{k: m[k] for k in ("role", "content", *sorted(set(m) - {"role", "content"}))}
                                        for m in messages]}
    if traj.tools:
        out["tools"] = traj.tools
    out["metadata"] = {"agent": agent.name, "split": scenario.split, "scenario_id": scenario.id, "seed": seed}
    return out


def score(agent: Agent, scenario: Scenario, line: dict[str, Any]) -> float:
    """The agent's reward of a stored line, recomputed from its messages (no rollout state)."""
    traj = Trajectory(messages_and_choices=line["messages"], tools=line.get("tools"))
    return combine_rewards(agent.reward(scenario, traj))[0]


async def _play(agent: Agent, expert: Any, scenarios: list[Scenario]) -> list[Trajectory]:
    policy = ScriptedPolicy(expert.act)
    return [await agent.rollout(policy, "expert", s) for s in scenarios]  # type: ignore[arg-type]


def demonstrations(agent_name: str, *, split: str = DEMO_SPLIT, count: int | None = None,
                   seed: int = 0) -> list[dict[str, Any]]:
    """The expert's lines for the first ``count`` (default all) train scenarios in ``seed`` order; see the rules."""
    check_request(agent_name, split, count)
    spec, agent = EXPERTS[agent_name], get_agent(agent_name)
    train = agent.scenarios(DEMO_SPLIT, seed)
    if count is not None and count > len(train):
        raise DemoError(f"count {count} is more than the {len(train)} train scenarios of {agent_name!r}")
    chosen = train[:count]
    trajs = asyncio.run(_play(agent, spec.build(agent, train, seed), chosen))
    lines, floor = [], spec.floor(agent)
    for scenario, traj in zip(chosen, trajs):
        line = record(agent, scenario, traj, seed)
        reward = score(agent, scenario, line)
        if reward < floor:
            raise DemoError(f"the {agent_name} expert scored {reward:g} < {floor:g} on {scenario.id}: "
                            f"{' | '.join(traj.logs)[:300]}")
        line["metadata"]["reward"] = reward
        lines.append(line)
    return lines


def to_jsonl(lines: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def check_out(path: str | Path) -> Path:
    """The file to write: its folder must exist and it must not be a folder itself."""
    path = Path(path)
    if path.is_dir():
        raise DemoError(f"--out {path} is a folder; name the JSONL file to write")
    if not path.parent.is_dir():
        raise DemoError(f"--out {path}: folder {path.parent} does not exist")
    return path


def write_demonstrations(path: str | Path, lines: list[dict[str, Any]]) -> Path:
    """Write ``lines`` as JSONL to ``path`` (see :func:`check_out`)."""
    path = check_out(path)
    path.write_text(to_jsonl(lines), encoding="utf-8")
    return path
