"""Running a deployment to completion when its machine may vanish: crashed runs are run again, failed ones are not.

Rule, for each attempt (at most ``attempts``), one new flow run of the deployment with the same parameters:

    Completed                                   -> done
    Crashed (its process died: a spot reclaim, a lost worker marked Crashed by Prefect or by an automation)
    or not final after ``timeout_s`` (its worker is gone and nothing marks it; it is set Crashed here)
                                                -> the next attempt
    Failed, Cancelled, ...                      -> DeploymentRunFailed at once: a bug, a bad input or a person;
                                                   running it again only repeats it
    after ``attempts`` crashes                  -> DeploymentRunCrashed, naming the count and each crash

``done()`` (the durable result in storage, or None) is read after every attempt: a run that crashed after writing
its result counts as done. Neither error is transient (tasks/support/retry_policy.py): the bound here is the
whole budget, not multiplied by the calling task's retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("trajflow")

T = TypeVar("T")

DEFAULT_ATTEMPTS = 3
POLL_S = 5.0


class DeploymentRunFailed(RuntimeError):
    """A run of the deployment ended Failed (or Cancelled): not run again."""


class DeploymentRunCrashed(RuntimeError):
    """Every attempt crashed or was lost; the message counts them."""


def _mark_lost(run, message: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)


def run_deployment_until_complete(deployment: str, parameters: dict[str, Any], done: Callable[[], T | None], *,
                                  what: str, timeout_s: float, attempts: int = DEFAULT_ATTEMPTS,
                                  poll_s: float = POLL_S) -> T:
    """Run `deployment` until one run completes (see the module rule); returns ``done()``."""
    from prefect.deployments import run_deployment

    crashes: list[str] = []
    for attempt in range(1, attempts + 1):
        run = run_deployment(deployment, parameters=parameters, timeout=timeout_s, poll_interval=poll_s)
        state = run.state
        if state is not None and not state.is_final():
            lost = f"no final state within {timeout_s:g} s (its worker is gone?)"
            _mark_lost(run, f"trajflow: {lost}; run again")
            crashes.append(f"{run.name}: {lost}")
        elif state is not None and state.is_crashed():
            crashes.append(f"{run.name}: crashed ({state.message})")
        result = done()
        if result is not None:
            return result
        if state is not None and state.is_completed():
            raise DeploymentRunFailed(f"{what}: deployment {deployment!r} run {run.name} completed without "
                                      "writing its result")
        if len(crashes) < attempt:  # neither crashed nor lost: Failed, Cancelled, or no state at all
            raise DeploymentRunFailed(
                f"{what}: deployment {deployment!r} run {run.name} ended "
                f"{getattr(state, 'name', 'without a state')}: {getattr(state, 'message', '')} "
                "(not run again: only a crash or a lost worker is)")
        if attempt < attempts:
            log.warning("%s: attempt %d of %d: %s; running deployment %s again", what, attempt, attempts,
                        crashes[-1], deployment)
    raise DeploymentRunCrashed(f"{what}: deployment {deployment!r} crashed {attempts} times "
                               f"(attempt {attempts} of {attempts}): " + "; ".join(crashes))
