"""Scenario sampling: which scenarios step k trains on, a pure function of (seed, step).

Train scenarios are shuffled once per epoch with ``Random(seed + epoch)``; step k takes the
``groups_per_step`` scenarios at cursor ``(k-1) * groups_per_step`` of that endless sequence. The
cursor is derived from the step number, so a resumed run continues exactly where it left off
without storing any cursor state.
"""

from __future__ import annotations

import random

from prefect import task

from agents.scenario import Scenario
from storage.layout import SCENARIOS
from tasks.run_config import RunConfig
from tasks.support.cache_keys import cache_key_fn
from tasks.support.retry_policy import retry_condition
from tasks.support.runtime import get_runtime


def pick_train_scenarios(pool: list[Scenario], seed: int, step: int, count: int) -> list[Scenario]:
    """The `count` scenarios of training step `step` (1-based) from an epoch-shuffled pool."""
    if not pool:
        raise ValueError("the agent returned no train scenarios")
    start = (step - 1) * count
    picked: list[Scenario] = []
    epoch_cache: dict[int, list[Scenario]] = {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, len(pool))
        if epoch not in epoch_cache:
            order = list(pool)
            random.Random(seed + epoch).shuffle(order)
            epoch_cache[epoch] = order
        picked.append(epoch_cache[epoch][offset])
    return picked


def sample_scenarios_fn(config: RunConfig, step: int) -> list[Scenario]:
    """Plain function behind the task: pick, then record the choice in the step folder."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    pool = rt.agent.scenarios("train", seed=config.seed)
    picked = pick_train_scenarios(pool, config.seed, step, config.groups_per_step)
    rt.store.put_json(step, SCENARIOS, [s.model_dump(mode="json") for s in picked])
    return picked


def val_scenarios(config: RunConfig) -> list[Scenario]:
    """The fixed validation set used by every evaluation of the run."""
    # this process's resources for the run (tasks/support/runtime.py)
    pool = get_runtime(config).agent.scenarios("val", seed=config.seed)
    if not pool:
        raise ValueError(f"agent {config.agent!r} has no val scenarios to evaluate on")
    return pool[: config.eval_scenarios]


@task(name="sample-scenarios", cache_key_fn=cache_key_fn("scenarios"), retries=2,
      retry_condition_fn=retry_condition, persist_result=True)
def sample_scenarios(config: RunConfig, step: int) -> list[Scenario]:
    return sample_scenarios_fn(config, step)
