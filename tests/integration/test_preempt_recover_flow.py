"""The `recover` flow (flows/recover.py) against a real Prefect API: its decisions, records, budget and idempotence.

A deployment of the `train` flow is registered on the session's API; each test makes flow runs of it end in the
state it needs (as a worker or the zombie automation would) and calls `recover` in this process. Nothing executes
the runs `recover` schedules: their parameters, tags, queue and start time are what is checked. The timing of a
real recovery, with workers and kills, is in test_preempt_recovery_e2e.py.
"""

from __future__ import annotations

import os
import time

import pytest

from flows.recover import RECOVERED_TAG, RecoveryStopped, plan_recovery, recover
from storage.layout import RUN_LEASE
from storage.lease import LeaseRecord
from storage.recoveries import RecoveryRecord, recovery_history, write_recovery
from storage.store import RunStore

BACKOFF_S = 30.0


@pytest.fixture
def train_deployment(prefect_api, tmp_path):
    """(client factory, deployment id, store) of a fresh `train/<unique>` deployment whose config names tmp storage."""
    from prefect.client.orchestration import get_client

    name = f"ui-{os.urandom(4).hex()}"
    config = {"run": "spot", "agent": "arithmetic", "base_model": "tiny-random", "storage": str(tmp_path / "runs"),
              "steps": 5}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("train")
        deployment_id = client.create_deployment(flow_id=flow_id, name=name, entrypoint="flows/train.py:train",
                                                 parameters={"config": config}, tags=["trajflow"])
    return deployment_id, RunStore(config["storage"], "trajflow", "spot")


def _ended_run(deployment_id, state: str, parameters: dict | None = None):
    """A flow run of the deployment (a partial config, as `prefect deployment run -p` gives) ended in `state`."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Failed, Running

    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters or {"config": {"steps": 5}},
                                                     tags=["nightly"])
        client.set_flow_run_state(run.id, Running(), force=True)
        end = Crashed(message="Process exited with status code: -9") if state == "crashed" else Failed(message="bug")
        client.set_flow_run_state(run.id, end, force=True)
        return client.read_flow_run(run.id)


def _runs_of(deployment_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def _record(step: int | None, decision: str = "rerun", at: float = 0.0) -> RecoveryRecord:
    return RecoveryRecord(flow_run_id=f"run-{at:.0f}", deployment="train/ui", crashed_at=at, committed_step=step,
                          attempt=1, decision=decision)


@pytest.mark.parametrize("history, committed, expected", [
    ([], 4, ("rerun", 1, BACKOFF_S)),
    ([_record(4, at=1)], 4, ("rerun", 2, 2 * BACKOFF_S)),
    ([_record(4, at=1), _record(4, at=2)], 4, ("rerun", 3, 4 * BACKOFF_S)),
    ([_record(4, at=1), _record(4, at=2), _record(4, at=3)], 4, ("stopped", 4, 0.0)),
    ([_record(2, at=1), _record(2, at=2), _record(3, at=3)], 4, ("rerun", 1, BACKOFF_S)),  # progress: a new count
    ([_record(4, at=1), _record(4, at=2), _record(4, "stopped", at=3)], 4, ("rerun", 1, BACKOFF_S)),  # after a stop
    ([_record(None, at=1)], None, ("rerun", 2, 2 * BACKOFF_S)),  # crashes before step 0 was committed
], ids=["first", "second", "third", "budget spent", "progress resets", "stop resets", "no step yet"])
def test_preempt_plan_counts_only_crashes_without_progress(history, committed, expected):
    assert plan_recovery(history, committed, attempts=3, backoff_s=BACKOFF_S) == expected


def test_preempt_plan_caps_the_back_off():
    history = [_record(1, at=i) for i in range(20)]
    assert plan_recovery(history, 1, attempts=50, backoff_s=BACKOFF_S) == ("rerun", 21, 600.0)


def test_preempt_a_crashed_run_is_run_again_once_with_its_parameters(train_deployment):
    deployment_id, store = train_deployment
    crashed = _ended_run(deployment_id, "crashed", {"config": {"steps": 7}})
    before = time.time()
    record = recover(f"prefect.flow-run.{crashed.id}", attempts=3, backoff_s=BACKOFF_S)  # as the trigger passes it
    assert record["decision"] == "rerun" and record["attempt"] == 1 and record["committed_step"] is None
    new = next(r for r in _runs_of(deployment_id) if str(r.id) == record["new_flow_run_id"])
    assert new.parameters == crashed.parameters == {"config": {"steps": 7}}
    assert RECOVERED_TAG in new.tags and "nightly" in new.tags and new.work_queue_name == crashed.work_queue_name
    assert new.state.is_scheduled()
    assert before + BACKOFF_S - 1 <= new.state.state_details.scheduled_time.timestamp() <= time.time() + BACKOFF_S + 1
    [stored] = recovery_history(store)
    assert stored.flow_run_id == str(crashed.id) and "status code: -9" in stored.message

    again = recover(str(crashed.id), attempts=3, backoff_s=BACKOFF_S)  # a duplicate event: nothing new
    assert again == record and len(_runs_of(deployment_id)) == 2 and len(recovery_history(store)) == 1


def test_preempt_the_budget_stops_a_crash_loop_and_a_later_crash_starts_a_new_count(train_deployment):
    deployment_id, store = train_deployment
    for i in range(3):
        write_recovery(store, _record(None, at=time.time() - 100 + i))
    crashed = _ended_run(deployment_id, "crashed")
    with pytest.raises(RecoveryStopped, match=r"crashed 4 times in a row at committed step None \(budget: 3\); "
                                              r"not run again.*resumes from storage"):
        recover(str(crashed.id), attempts=3, backoff_s=BACKOFF_S)
    assert recovery_history(store)[-1].decision == "stopped" and len(_runs_of(deployment_id)) == 1

    later = _ended_run(deployment_id, "crashed")  # someone started it again by hand, and it crashed
    assert recover(str(later.id), attempts=3, backoff_s=BACKOFF_S)["attempt"] == 1


def test_preempt_a_lease_another_machine_may_hold_delays_the_rerun_to_its_expiry(train_deployment):
    deployment_id, store = train_deployment
    now = time.time()
    lost = LeaseRecord(owner="spot-7:41:abc", host="spot-7.internal", pid=41, purpose="trajflow train",
                       acquired_at=now - 500, renewed_at=now - 20, expires_at=now + 280)
    store._loc.write_bytes(RUN_LEASE, lost.model_dump_json().encode())
    record = recover(str(_ended_run(deployment_id, "crashed").id), attempts=3, backoff_s=BACKOFF_S)
    assert record["scheduled_for"] == pytest.approx(now + 282, abs=1) and "lease expires" in record["reason"]


@pytest.mark.parametrize("case, expected", [
    ("failed", "its state is Failed, not Crashed"),
    ("not train", "a run of flow 'evaluate': only 'train' runs are recovered here"),
    ("no deployment", "not a deployment's run (started by hand)"),
])
def test_preempt_nothing_to_recover(case, expected, train_deployment):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    deployment_id, store = train_deployment
    if case == "failed":
        run_id = _ended_run(deployment_id, "failed").id
    else:
        named = flow(name="evaluate" if case == "not train" else "train")(lambda: None)
        with get_client(sync_client=True) as client:
            run_id = client.create_flow_run(named, state=Crashed(message="killed")).id
    result = recover(str(run_id), attempts=3, backoff_s=BACKOFF_S)
    assert result == {"decision": "none", "reason": result["reason"]} and expected in result["reason"]
    assert recovery_history(store) == [] and len(_runs_of(deployment_id)) == (1 if case == "failed" else 0)
