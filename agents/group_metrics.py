"""Summary metrics of scored groups, shared by the flow's scoring task and the ART-style backends."""

from __future__ import annotations

import math

from agents.trajectory import TrajectoryGroup

# name -> (numerator, denominator): per-trajectory counts whose ratio of sums is the metric. A mean of per-episode
# ratios would weigh an episode of one call like one of ten; these weigh every call (every reply) the same.
RATIOS: dict[str, tuple[str, str]] = {
    "tool_call_validity": ("valid_tool_calls", "tool_calls"),  # research: well-formed calls / calls attempted
    "illegal_move_rate": ("illegal", "turns"),  # tic-tac-toe: illegal replies / replies
}


def summarize(groups: list[TrajectoryGroup], prefix: str = "train") -> dict[str, float]:
    """``<prefix>/reward`` (mean over healthy trajectories), ``reward_std`` (population std),
    ``trajectories``, ``failed`` (recorded exceptions + trajectories with an error), the mean of every
    finite numeric per-trajectory metric, and each of :data:`RATIOS` whose two counts the trajectories
    carry: sum(numerator) / sum(denominator), left out while the denominator sums to 0."""
    rewards = [t.reward for g in groups for t in g.trajectories if not t.error]
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) if n else 0.0
    out: dict[str, float] = {
        f"{prefix}/reward": mean,
        f"{prefix}/reward_std": std,
        f"{prefix}/trajectories": float(n),
        f"{prefix}/failed": float(sum(len(g.exceptions) for g in groups)
                                  + sum(1 for g in groups for t in g.trajectories if t.error)),
    }
    values: dict[str, list[float]] = {}
    for g in groups:
        for t in g.trajectories:
            if t.error:
                continue
            for k, v in t.metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    values.setdefault(k, []).append(float(v))
    for k, vs in values.items():
        out[f"{prefix}/{k}"] = sum(vs) / len(vs)
    for name, (num, den) in RATIOS.items():
        if num in values and den in values and len(values[num]) == len(values[den]) and sum(values[den]) > 0:
            out[f"{prefix}/{name}"] = sum(values[num]) / sum(values[den])
    return out


def merge_step_metrics(agent: dict[str, float], *system: dict[str, float]) -> dict[str, float]:
    """A step's metrics; an agent metric named like a trainer/publish one (e.g. an agent's `loss`
    becoming `train/loss`) is kept as `<name>.agent` instead of being silently overwritten."""
    merged: dict[str, float] = {}
    for part in system:
        merged.update(part)
    for key, value in agent.items():
        merged[f"{key}.agent" if key in merged else key] = value
    return merged
