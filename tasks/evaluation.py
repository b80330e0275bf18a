"""Evaluation: the agent's own reward of one policy on the run's fixed validation scenarios.

One rollout per validation scenario, stored under ``eval/`` in the step folder and summarised as
``val/*`` metrics. Every evaluation of a run uses the same sampling seeds (derived from (run, "step 0",
scenario)), so the val curve compares policies on identical draws instead of adding seed noise. The
judge is not used: validation compares policies on the agent's verifiable reward.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from storage.layout import EVAL_GROUPS_DIR, EVAL_SCORED
from tasks.rollouts import run_groups
from tasks.run_config import RunConfig
from tasks.scenarios import val_scenarios
from tasks.scoring import score_groups_fn
from tasks.support.cache_keys import cache_key_fn
from tasks.support.retry_policy import retry_condition
from tasks.support.shared_loop import run_on_shared_loop


def evaluate_policy_fn(config: RunConfig, step: int, policy: str | None = None) -> dict[str, float]:
    """Evaluate `policy` (default: the run's policy after `step` updates); stored in step `step`'s folder."""
    policy_step = step if policy is None else None
    policy = policy or config.policy(step)
    scenarios = val_scenarios(config)
    rollouts = run_on_shared_loop(run_groups(config, 0, scenarios, policy, EVAL_GROUPS_DIR, 1,
                                             f"eval step {step} ({policy})", storage_step=step,
                                             policy_step=policy_step))
    scored = score_groups_fn(config, step, scenarios, rollouts, out=EVAL_SCORED, prefix="val", use_judge=False)
    return scored["metrics"]


@task(name="evaluate", cache_key_fn=cache_key_fn("evaluation"), retries=2, retry_delay_seconds=[5, 30],
      retry_condition_fn=retry_condition, persist_result=True)
def evaluate_policy(config: RunConfig, step: int) -> dict[str, Any]:
    return evaluate_policy_fn(config, step)
