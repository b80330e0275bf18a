"""Scoring: the agent's own reward for every trajectory, then optionally the LLM judge per group.

The reward is recomputed from the stored trajectory with ``agent.reward(scenario, trajectory)`` (a
float or named components, combined by ``config.rewards``). A reward that raises or is not finite
marks that trajectory failed (``error`` set, metric ``reward_error``): it is kept for inspection but
never trained on. With a judge configured, each group is ranked by it (cached by content hash in the
run's storage, so a resumed step costs no judge call) and combined per ``config.rewards.mode``.
Scored groups are written to ``scored.parquet``; the task returns only paths and summary metrics.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefect import task

from agents.group_metrics import summarize
from agents.rewards import set_reward
from agents.scenario import Scenario
from agents.trajectory import TrajectoryGroup
from storage.judge_cache import StoreJudgeCache
from storage.layout import SCORED
from tasks.rollouts import read_groups
from tasks.run_config import RunConfig
from tasks.support.cache_keys import cache_key_fn
from tasks.support.retry_policy import retry_condition
from tasks.support.runtime import Runtime, get_runtime
from tasks.support.tracing import get_tracer, rollout_trace_id

log = logging.getLogger("trajflow")


def apply_agent_reward(rt: Runtime, scenario: Scenario | None, group: TrajectoryGroup) -> None:
    """Set every healthy trajectory's reward from the agent; failures become recorded errors."""
    for traj in group.trajectories:
        if traj.error:
            continue
        try:
            own = rt.agent.reward(scenario, traj)
            set_reward(traj, own, rt.config.rewards)
        except Exception as exc:  # noqa: BLE001 - a bad reward is data about this trajectory
            traj.error = f"reward failed: {type(exc).__name__}: {exc}"
            traj.metrics["reward_error"] = 1
            traj.reward = 0.0


async def _judge_all(rt: Runtime, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Judge groups concurrently (at most ``judge.max_concurrency`` at once, one shared client), in order.

    A group with fewer than two healthy trajectories has nothing to rank and keeps its rewards. Verdicts
    are cached as each arrives, so if one group fails (on_failure='fail'), a retry re-asks only the rest.
    """
    from agents.judge import judge_group

    config = rt.config.judge
    cache = StoreJudgeCache(rt.store)
    description = getattr(rt.agent, "system_prompt", None) or None
    limit = asyncio.Semaphore(config.max_concurrency)
    client = config.make_client()

    async def one(group: TrajectoryGroup) -> TrajectoryGroup:
        if sum(1 for t in group.trajectories if not t.error) < 2:
            return group
        async with limit:
            return await judge_group(group, config, client=client, cache=cache, task_description=description,
                                     rewards=rt.config.rewards)

    try:
        return list(await asyncio.gather(*(one(g) for g in groups)))
    finally:
        await client.close()


def _trace_scores(config: RunConfig, step, groups: list[TrajectoryGroup]) -> None:
    """Reward, judge score and components on each rollout's trace (no-op without Langfuse keys)."""
    tracer = get_tracer()
    if not tracer.enabled or step is None:
        return
    for group in groups:
        for traj in group.trajectories:
            index = traj.metadata.get("index")
            if index is not None:
                tracer.score_trajectory(rollout_trace_id(config.run, step, group.scenario_id, int(index)), traj)
    tracer.flush()


def score_groups_fn(config: RunConfig, step: int, scenarios: list[Scenario], rollouts: dict[str, Any],
                    out: str = SCORED, prefix: str = "train",
                    use_judge: bool = True) -> dict[str, Any]:
    """Score the stored groups of a step and write them to `out`; returns summary metrics."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    by_id = {s.id: s for s in scenarios}
    groups = read_groups(config, step, rollouts["paths"])
    for group in groups:
        apply_agent_reward(rt, by_id.get(group.scenario_id), group)
    if use_judge and config.judge is not None:
        groups = asyncio.run(_judge_all(rt, groups))
    rt.store.write_groups(step, out, groups)
    _trace_scores(config, step, groups)
    metrics = summarize(groups, prefix)
    log.info("step %s %s: reward %.3f ± %.3f over %d trajectories (%d failed)", step, prefix,
             metrics[f"{prefix}/reward"], metrics[f"{prefix}/reward_std"],
             int(metrics[f"{prefix}/trajectories"]), int(metrics[f"{prefix}/failed"]))
    return {"path": out, "metrics": metrics}


@task(name="score", task_run_name="score-step-{step}", cache_key_fn=cache_key_fn("scoring"), retries=2,
      retry_delay_seconds=[5, 30], retry_condition_fn=retry_condition, persist_result=True)
def score_groups(config: RunConfig, step: int, scenarios: list[Scenario], rollouts: dict[str, Any]) -> dict[str, Any]:
    return score_groups_fn(config, step, scenarios, rollouts)
