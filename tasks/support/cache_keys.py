"""The cache-key rule, in one place: ``<run>/step-<NNNNN>/<stage>-v<N>``, and for rollouts
``<run>/step-<NNNNN>/rollouts-v<N>-policy-<PPPPP>``: the step of the policy that samples them.

Keys are readable, identical in every process and on every machine, and never contain the Prefect
run id, so a new flow run of the same config (after a kill, on a fresh Prefect home) finds the results
that the killed run persisted. Bump a stage's version when its output format or semantics change. The
rollouts' key names their sampling policy step (``pipeline.max_off_policy_steps`` decides it): a run resumed
under another k runs the task again, which samples the missing groups with its own policy and keeps the stored
ones (the trainer refuses any outside its bound, backends/policy/staleness.py).
"""

from __future__ import annotations

from backends.policy.staleness import sampling_step

STAGE_VERSIONS: dict[str, int] = {
    "sft": 1,
    "scenarios": 1,
    "rollouts": 1,
    "scoring": 1,
    "training": 1,
    "publish": 1,
    "evaluation": 1,
}


def stage_key(run: str, step: int, stage: str) -> str:
    """The cache key of one stage of one step."""
    return f"{run}/step-{step:05d}/{stage}-v{STAGE_VERSIONS[stage]}"


def cache_key_fn(stage: str):
    """A Prefect ``cache_key_fn`` reading ``config`` (a RunConfig) and ``step`` from the task's parameters."""

    def key(context, parameters) -> str:
        return stage_key(parameters["config"].run, int(parameters["step"]), stage)

    key.__name__ = f"{stage}_cache_key"
    return key


def sampled_cache_key_fn(stage: str):
    """Like :func:`cache_key_fn`, the key ending in ``-policy-<PPPPP>``, the step's sampling policy step."""

    def key(context, parameters) -> str:
        config, step = parameters["config"], int(parameters["step"])
        policy_step = sampling_step(step, config.pipeline.max_off_policy_steps)
        return f"{stage_key(config.run, step, stage)}-policy-{policy_step:05d}"

    key.__name__ = f"{stage}_cache_key"
    return key
