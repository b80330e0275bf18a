"""The `recover` flow: a crashed training run of a deployment is run again, with the same parameters, after a back-off.

An automation declared in prefect.yaml (the `recover` deployment's trigger) runs this flow for every flow run of
``train`` from a deployment that enters ``Crashed``: its process died (a spot reclaim, SIGKILL, an out-of-memory
kill, a SIGTERM the flow honoured) or its heartbeats stopped (the zombie automation `trajflow deploy` creates
marks it Crashed). ``Failed`` runs (a bug, a bad config) never get here: running them again only repeats them.

Rule, with ``S`` the run's last committed step when the crash is handled and ``n`` the crashes in a row with the
same ``S`` (this one included; a record that stopped starts a new count):

    n <= attempts  ->  a new flow run of the same deployment, same parameters (so the same RunConfig: it resumes
                       the same run from storage) and work queue, scheduled ``min(backoff_s * 2**(n-1), 600)`` s later, and no
                       earlier than the run's lease expiry when another live-looking holder has it (a machine
                       that vanished cannot release its lease; a process of this host that is gone frees it at once)
    n >  attempts  ->  nothing is started; the `recover` run fails, saying why and how to go on

A run that commits steps between crashes is never stopped: only crashes without progress spend the budget.
Each decision is a record in the run's storage (storage/recoveries.py), keyed by the crashed flow run, and the
new run is created with an idempotency key derived from it: handling one crash twice starts one run.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from prefect import flow
from pydantic import Field

from flows.deployment_defaults import overlay
from storage.lease import RunLease
from storage.recoveries import RecoveryRecord, read_recovery, recovery_history, write_recovery
from storage.store import RunStore
from tasks.run_config import RunConfig

log = logging.getLogger("trajflow")

TRAIN_FLOW = "train"
MAX_DELAY_S = 600.0
LEASE_MARGIN_S = 2.0  # start after the lease has surely expired, not at the same second
RECOVERED_TAG = "recovered"


class RecoveryStopped(RuntimeError):
    """The run crashed `attempts` times in a row without committing a step: it is not run again."""


def plan_recovery(history: list[RecoveryRecord], committed_step: int | None, attempts: int,
                  backoff_s: float) -> tuple[str, int, float]:
    """(decision, n, delay_s) for a new crash of a run with `history` (the module rule; lease not included)."""
    streak = 0
    for record in reversed(history):
        if record.decision == "stopped" or record.committed_step != committed_step:
            break
        streak += 1
    attempt = streak + 1
    if attempt > attempts:
        return "stopped", attempt, 0.0
    return "rerun", attempt, min(backoff_s * 2 ** (attempt - 1), MAX_DELAY_S)


def _effective_config(run_parameters: dict[str, Any], deployment_parameters: dict[str, Any]) -> RunConfig:
    """The RunConfig the crashed run trained with: its `config` over its deployment's (flows/deployment_defaults)."""
    given = RunConfig.model_validate(run_parameters.get("config") or {})
    base = deployment_parameters.get("config")
    return RunConfig.model_validate(overlay(base, given)) if isinstance(base, dict) else given


def _lease_free_at(store: RunStore) -> float | None:
    """When the run's lease frees up, if a holder that may still live has it (storage/lease.py's takeover rule)."""
    blocker = RunLease(store, "trajflow recover").blocker()
    return None if blocker is None else blocker.expires_at + LEASE_MARGIN_S


@flow(name="recover", log_prints=True)
def recover(flow_run_id: str,
            attempts: Annotated[int, Field(ge=0, le=100)] = 3,
            backoff_s: Annotated[float, Field(ge=0, le=MAX_DELAY_S)] = 10.0) -> dict[str, Any]:
    """Run the crashed `train` flow run `flow_run_id` (a uuid, or an event's ``prefect.flow-run.<uuid>``) again.

    Returns its recovery record (storage/recoveries.py) as a dict, or {"decision": "none", "reason": ...} when
    there is nothing to recover (not crashed, not a training run, not from a deployment).
    """
    from prefect.client.orchestration import get_client

    run_id = flow_run_id.removeprefix("prefect.flow-run.")
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        flow_name = client.read_flow(run.flow_id).name
        deployment = client.read_deployment(run.deployment_id) if run.deployment_id else None
    nothing = _nothing_to_do(run, flow_name, deployment)
    if nothing:
        log.info("recover %s: %s", run.name, nothing)
        return {"decision": "none", "reason": nothing}
    label = f"{flow_name}/{deployment.name}"
    config = _effective_config(run.parameters or {}, deployment.parameters or {})
    store = RunStore(config.storage, config.project, config.run)
    earlier = read_recovery(store, str(run.id))
    if earlier is not None:
        log.info("recover %s: already handled (%s%s)", run.name, earlier.decision,
                 f", as {earlier.new_flow_run_name}" if earlier.new_flow_run_name else "")
        return earlier.model_dump(mode="json")
    committed = store.latest_step()
    decision, attempt, delay = plan_recovery(recovery_history(store), committed, attempts, backoff_s)
    record = RecoveryRecord(flow_run_id=str(run.id), flow_run_name=run.name, deployment=label,
                            crashed_at=run.state.timestamp.timestamp(), message=run.state.message or "",
                            committed_step=committed, attempt=attempt, decision=decision)
    where = f"run {config.project}/{config.run} ({store.url}), last committed step {committed}"
    if decision == "stopped":
        record.reason = (f"crashed {attempt} times in a row at committed step {committed} (budget: {attempts}); "
                         "not run again")
        write_recovery(store, record)
        raise RecoveryStopped(
            f"{label} run {run.name} crashed; {where}: {record.reason}. Look at the crashed runs' logs, then "
            f"start it again (`prefect deployment run '{label}'` with the same config, or `trajflow train`): it "
            "resumes from storage, and a later crash starts a new count")
    now = time.time()
    start_at = now + delay
    free_at = _lease_free_at(store)
    if free_at is not None and free_at > start_at:
        start_at = free_at
        record.reason = "after the run's lease expires (its holder may live on a lost machine)"
    record.delay_s = round(start_at - now, 3)
    record.scheduled_for = start_at
    new = _run_again(run, deployment.id, start_at)
    record.new_flow_run_id, record.new_flow_run_name = str(new.id), new.name
    write_recovery(store, record)
    log.warning("recover: %s run %s crashed (%s); %s; running it again as %s in %.0f s (crash %d of %d in a row "
                "without a new committed step)", label, run.name, record.message or "no message", where, new.name,
                record.delay_s, attempt, attempts)
    return record.model_dump(mode="json")


def _nothing_to_do(run, flow_name: str, deployment) -> str | None:
    """Why this flow run is not recovered, or None when it is."""
    if run.state is None or not run.state.is_crashed():
        return f"its state is {getattr(run.state, 'name', None)}, not Crashed: nothing to do"
    if flow_name != TRAIN_FLOW:
        return f"a run of flow {flow_name!r}: only {TRAIN_FLOW!r} runs are recovered here"
    if deployment is None:
        return "not a deployment's run (started by hand): start it again the same way; it resumes from storage"
    return None


def _run_again(run, deployment_id, start_at: float):
    """A new flow run of `deployment_id` with `run`'s parameters, tags, job variables and work queue (its placement:
    a GPU queue stays a GPU queue), scheduled at `start_at`."""
    from prefect.deployments import run_deployment

    tags = sorted(set(run.tags or []) | {RECOVERED_TAG})
    return run_deployment(deployment_id, parameters=dict(run.parameters or {}), timeout=0, as_subflow=False,
                          scheduled_time=datetime.fromtimestamp(start_at, UTC), tags=tags,
                          job_variables=run.job_variables or None, work_queue_name=run.work_queue_name,
                          idempotency_key=f"trajflow-recover-{run.id}")

