"""Rollouts: every scenario's group, run concurrently with asyncio inside one task.

- One Prefect task per step (not per LLM call): rollouts are asyncio coroutines bounded by a
  semaphore of ``rollouts.concurrency``, each with a ``rollouts.timeout_s`` deadline.
- A rollout that raises or times out is recorded as an exception in its group, never a crash.
- Each group is written to storage (``groups/<NNNN>.parquet``, atomically) the moment it completes;
  a rerun of the step reads finished groups back and only runs the missing ones, so a kill loses at
  most the groups in flight.
- Sampling is reproducible: every call's seed derives from (run, step, scenario, index); the policy is the one
  ``pipeline.max_off_policy_steps`` assigns to the step (backends/policy/staleness.py), recorded in each group
  as its ``policy_step``.
- Past ``rollouts.max_failure_fraction`` failed rollouts the task fails, showing the first errors (and,
  when the vLLM the run launched has died, its exit code and log tail) and deleting the groups that hold
  failures, so that a rerun runs them again; when every failure's type is a transient one
  (``tasks.support.retry_policy``: connection loss, timeouts of the client, 5xx), the failure is transient
  and retried. A retry finds a dead vLLM restarted
  (``Runtime.ensure_server``) and reloads the policy's adapter from storage if the server lost it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import task

from agents.client import rollout_context, rollout_seed_material
from agents.scenario import Scenario
from agents.trajectory import RecordedException, Trajectory, TrajectoryGroup
from backends.policy.staleness import sampling_step
from storage.layout import GROUPS_DIR, group_file
from tasks.run_config import RunConfig
from tasks.support.cache_keys import sampled_cache_key_fn
from tasks.publish import ensure_served
from tasks.support.crash_points import crash_point
from tasks.support.preemption import preemption_requested, stop_if_requested
from tasks.support.progress import Progress
from tasks.support.retry_policy import TransientError, is_transient_type_name, retry_condition
from tasks.support.runtime import Runtime, get_runtime
from tasks.support.shared_loop import run_on_shared_loop
from tasks.support.tracing import get_tracer

log = logging.getLogger("trajflow")

PREEMPTION_POLL_S = 0.2  # how soon a SIGTERM stops the rollouts: well inside any grace period
READ_THREADS = 16  # group files read at once when a step's groups are read back


class RolloutFailures(RuntimeError):
    """Too many rollouts failed; the message lists the first errors."""


class RolloutsAbandoned(RuntimeError):
    """Rollouts running ahead of the trainer were stopped because the flow stopped."""


class RolloutTimeout(TimeoutError):
    """One rollout ran past its deadline."""


async def _one_rollout(rt: Runtime, client, policy: str, scenario: Scenario, step: int, index: int,
                       sem: asyncio.Semaphore, tracer) -> Trajectory:
    cfg = rt.config
    material = rollout_seed_material(cfg.run, step, scenario.id, index)
    async with sem:
        with tracer.rollout_trace(cfg.run, step, scenario.id, index, input={"scenario": scenario.id},
                                  metadata={"policy": policy}) as trace:
            observer = None
            if trace.enabled:
                def observer(rec):
                    trace.generation("policy.chat", rec.model, input=rec.request_messages,
                                     output=rec.response_message,
                                     usage={"input": rec.prompt_tokens, "output": rec.completion_tokens},
                                     latency_s=rec.latency_s)
            with rollout_context(material, observer=observer):
                try:
                    traj = await asyncio.wait_for(rt.traced_rollout()(client, policy, scenario), cfg.rollouts.timeout_s)
                except asyncio.TimeoutError:
                    raise RolloutTimeout(f"rollout {index} of scenario {scenario.id!r} exceeded "
                                         f"{cfg.rollouts.timeout_s:g}s") from None
            if not isinstance(traj, Trajectory):
                raise TypeError(f"{type(rt.agent).__name__}.rollout returned {type(traj).__name__}, "
                                "expected Trajectory")
            trace.update(output={"reward": traj.reward, "metrics": traj.metrics})
    traj.metadata.update({"scenario_id": scenario.id, "index": index, "step": step, "policy": policy})
    return traj


async def _run_group(rt: Runtime, client, policy: str, policy_step: int | None, scenario: Scenario, step: int,
                     group_size: int, sem: asyncio.Semaphore, tracer) -> TrajectoryGroup:
    results = await asyncio.gather(
        *(_one_rollout(rt, client, policy, scenario, step, i, sem, tracer) for i in range(group_size)),
        return_exceptions=True,
    )
    group = TrajectoryGroup(scenario_id=scenario.id, policy_step=policy_step, metadata={"step": step, "policy": policy})
    for result in results:  # index order, not completion order: reruns store identical groups
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            group.exceptions.append(RecordedException.from_exception(result))
        else:
            group.trajectories.append(result)
    return group


async def _unless_preempted(work, step: int, label: str, abandon) -> None:
    """Await `work`; on SIGTERM (tasks/support/preemption.py) or once `abandon` (an Event) is set, cancel it and
    stop: the groups in flight are abandoned, a group write already started finishes (run_groups waits for it) or
    never appears."""
    work = asyncio.ensure_future(work)
    while not work.done():
        await asyncio.wait({work}, timeout=PREEMPTION_POLL_S)
        if (preemption_requested() or abandon.is_set()) and not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            stop_if_requested(step, f"the remaining groups of {label}")
            raise RolloutsAbandoned(f"{label}: abandoned, the flow stopped")
    await work


async def run_groups(config: RunConfig, step: int, scenarios: list[Scenario], policy: str, prefix: str,
                     group_size: int, label: str, *, storage_step: int | None,
                     policy_step: int | None = None) -> dict[str, Any]:
    """Run (or read back) one group per scenario; returns paths and counts. Plain async, no Prefect needed.

    `step` seeds the rollouts (evaluations pass 0, so every policy answers the same draws); the groups
    are stored under `prefix` in the folder of step `storage_step`, or at the run level when it is
    None (evaluations outside the step sequence). `policy_step` is recorded in each group: the step of
    the run's policy `policy` is (None: another model).
    """
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    store = rt.store
    todo = [(i, s) for i, s in enumerate(scenarios) if not store.exists(storage_step, group_file(prefix, i))]
    reused = len(scenarios) - len(todo)
    if reused:
        log.info("%s: %d of %d groups already stored, running %d", label, reused, len(scenarios), len(todo))
    progress = await Progress(label, total=len(todo) * group_size).start()
    sem = asyncio.Semaphore(config.rollouts.concurrency)
    tracer = get_tracer()
    rewards: list[float] = []
    failures: list[RecordedException] = []
    failed_groups: list[int] = []

    writes: list[asyncio.Future] = []  # shielded: a cancelled group task leaves its write running, awaited below

    async def group_task(client, i: int, scenario: Scenario) -> None:
        group = await _run_group(rt, client, policy, policy_step, scenario, step, group_size, sem, tracer)
        writes.append(asyncio.ensure_future(
            asyncio.to_thread(store.write_groups, storage_step, group_file(prefix, i), [group])))
        await asyncio.shield(writes[-1])
        crash_point("rollouts-group", step)
        rewards.extend(group.rewards)
        failures.extend(group.exceptions)
        if group.exceptions:
            failed_groups.append(i)
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        await progress.advance(group_size, extra=f"reward={mean:.3f} failed={len(failures)}")

    try:
        async with rt.policy_client() as client:
            await _unless_preempted(asyncio.gather(*(group_task(client, i, s) for i, s in todo)),
                                    storage_step if storage_step is not None else step, label, rt.stop_rollouts)
    finally:
        await asyncio.gather(*writes, return_exceptions=True)  # a write already started finishes before we return
        tracer.flush()
    total = len(todo) * group_size
    if total and len(failures) > config.rollouts.max_failure_fraction * total:
        first = "\n".join(f"- {e.type}: {e.message}" for e in failures[:5])
        message = (f"{len(failures)} of {total} rollouts failed (limit {config.rollouts.max_failure_fraction:.0%} "
                   f"of {total}); first errors:\n{first}")
        # The groups holding failures are not kept: the retry (or the resumed run) runs them again rather than
        # reading back what a dead server or a broken agent produced; groups that fully succeeded stay.
        for i in failed_groups:
            await asyncio.to_thread(store.delete, storage_step, group_file(prefix, i))
        died = rt.server_failure()
        if died is not None:
            message += f"\n{died}"
        if all(is_transient_type_name(e.type) for e in failures):
            raise TransientError(message)
        raise RolloutFailures(message)
    return {
        "paths": [group_file(prefix, i) for i in range(len(scenarios))],
        "ran_groups": len(todo),
        "reused_groups": reused,
        "failed_rollouts": len(failures),
        "failure_types": dict(Counter(e.type for e in failures)),
    }


def read_groups(config: RunConfig, step: int, paths: list[str]) -> list[TrajectoryGroup]:
    """The groups stored under `paths`, in order; the files are read concurrently (one round trip on S3, not one
    per group)."""
    store = get_runtime(config).store  # this process's resources for the run (tasks/support/runtime.py)
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(paths))) as pool:
        return [group for groups in pool.map(lambda path: store.read_groups(step, path), paths) for group in groups]


def run_rollouts_fn(config: RunConfig, step: int, scenarios: list[Scenario]) -> dict[str, Any]:
    """Training rollouts of step `step`, sampled by the policy after ``sampling_step(step, k)`` updates: step-1 in
    the synchronous loop, step-1-k with ``pipeline.max_off_policy_steps = k`` (backends/policy/staleness.py)."""
    policy_step = sampling_step(step, config.pipeline.max_off_policy_steps)
    policy = config.policy(policy_step)

    async def rollouts() -> dict[str, Any]:
        await ensure_served(get_runtime(config), policy_step)
        return await run_groups(config, step, scenarios, policy, GROUPS_DIR, config.group_size,
                                f"rollouts step {step} ({policy})", storage_step=step, policy_step=policy_step)

    return run_on_shared_loop(rollouts())  # the run's policy client and connections carry over between steps


@task(name="rollouts", task_run_name="rollouts-step-{step}", cache_key_fn=sampled_cache_key_fn("rollouts"), retries=3,
      retry_delay_seconds=[2, 10, 30],
      retry_condition_fn=retry_condition, persist_result=True)
def run_rollouts(config: RunConfig, step: int, scenarios: list[Scenario]) -> dict[str, Any]:
    return run_rollouts_fn(config, step, scenarios)


__all__ = ["run_rollouts", "run_rollouts_fn", "run_groups", "read_groups", "RolloutFailures", "RolloutsAbandoned"]
