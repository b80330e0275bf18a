"""The few trajectories of a step a tracker shows as a table: which ones, and as what text.

Rule: round-robin over the groups (the first trajectory of each group, then the second...) until ``count`` rows, so
every scenario of the step shows before any shows twice; deterministic, so a resumed step shows the same rows. Each
row is ``[step, scenario, reward, conversation]``; the conversation is ``role: content`` lines (tool calls as
``name(arguments)``), credentials from the environment redacted, cut at MAX_TEXT characters. Token ids and logprobs
never leave.
"""

from __future__ import annotations

import json
from typing import Any

from agents.secrets import environment_secrets, redact
from agents.trajectory import Trajectory, TrajectoryGroup

COLUMNS = ["step", "scenario", "reward", "conversation"]
MAX_TEXT = 4000


def conversation_text(traj: Trajectory) -> str:
    lines = []
    for message in traj.messages():
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        calls = [f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})"
                 for c in message.get("tool_calls") or []]
        lines.append(f"{message.get('role', '?')}: {content}" + (f" -> {'; '.join(calls)}" if calls else ""))
    if traj.error:
        lines.append(f"error: {traj.error}")
    return "\n".join(lines)


def sample_rows(step: int, groups: list[TrajectoryGroup], count: int) -> list[list[Any]]:
    secrets = environment_secrets()
    rows: list[list[Any]] = []
    depth = 0
    while len(rows) < count and any(depth < len(g.trajectories) for g in groups):
        for group in groups:
            if depth < len(group.trajectories) and len(rows) < count:
                traj = group.trajectories[depth]
                text = redact(conversation_text(traj), secrets)
                rows.append([step, group.scenario_id or "", float(traj.reward),
                             text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " [cut]"])
        depth += 1
    return rows
