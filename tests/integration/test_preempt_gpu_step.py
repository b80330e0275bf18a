"""The GPU step (training.mode=deployment) when its machine is reclaimed: `train_remote` against a real Prefect API.

A deployment `train-step/<unique>` is registered on the session's API; a thread plays its GPU worker, taking each
new flow run of it and ending it as scripted, through the API's state endpoints (what a worker and its flow-run
process do): `crash` (Running -> Crashed, as Prefect reports a killed process), `lost` (Running, then nothing:
the machine vanished), `fail` (Running -> Failed: a bug), `complete` (writes the step's training.json, then
Completed). Asserted: crashed and lost runs are run again and the step completes; a Failed run is not run again;
the bound holds and the error counts the attempts; a lost run is left Crashed, not Running.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from backends.policy.checkpoints import training_result
from storage.layout import TRAINING_RESULT
from tasks.run_config import load_config
from tasks.support.deployment_attempts import DeploymentRunCrashed, DeploymentRunFailed
from tasks.support.runtime import close_runtime, get_runtime
from tasks.training import train_remote


class ScriptedGpuWorker:
    """Ends each new flow run of `deployment_id` by the next outcome of `script`."""

    def __init__(self, deployment_id, store, step: int, script: list[str]):
        self.deployment_id, self.store, self.step = deployment_id, store, step
        self.script = list(script)
        self.runs: list = []  # flow run ids, in the order taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        from prefect.states import Completed, Crashed, Failed, Running

        with get_client(sync_client=True) as client:
            while not self._stop.is_set():
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(
                    any_=[self.deployment_id])))
                for run in sorted(runs, key=lambda r: r.created):
                    if run.id in self.runs or not run.state.is_scheduled():
                        continue
                    self.runs.append(run.id)
                    outcome = self.script.pop(0)
                    client.set_flow_run_state(run.id, Running(), force=True)
                    if outcome == "crash":
                        client.set_flow_run_state(run.id, Crashed(message="Execution was aborted by a "
                                                                  "termination signal."), force=True)
                    elif outcome == "fail":
                        client.set_flow_run_state(run.id, Failed(message="ValueError: a bug"), force=True)
                    elif outcome == "complete":
                        self.store.put_json(self.step, TRAINING_RESULT, {"step": self.step, "metrics": {}})
                        client.set_flow_run_state(run.id, Completed(), force=True)
                time.sleep(0.05)

    def states(self) -> list[str]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return [client.read_flow_run(run_id).state.type.value for run_id in self.runs]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def gpu_step(prefect_api, tmp_path):
    """(config, store, start(script) -> ScriptedGpuWorker) for a fresh deployment of the train-step flow."""
    from prefect.client.orchestration import get_client

    name = f"gpu-{os.urandom(4).hex()}"
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("train-step")
        deployment_id = client.create_deployment(flow_id=flow_id, name=name,
                                                 entrypoint="flows/train_step.py:train_step")
    config = load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", "run=gpu", "training.mode=deployment",
                                               f"training.deployment=train-step/{name}", "training.timeout_s=3"])
    store = get_runtime(config).store
    workers: list[ScriptedGpuWorker] = []

    def start(script: list[str]) -> ScriptedGpuWorker:
        workers.append(ScriptedGpuWorker(deployment_id, store, 1, script))
        return workers[-1]

    yield config, store, start
    for worker in workers:
        worker.stop()
    close_runtime(config)


@pytest.mark.timeout(60)
def test_preempt_gpu_step_crashed_and_lost_runs_are_run_again(gpu_step):
    config, store, start = gpu_step
    worker = start(["crash", "lost", "complete"])
    result = train_remote(config, 1, attempts=3, poll_s=0.1)
    assert result == training_result(store, 1) == {"step": 1, "metrics": {}}
    assert worker.states() == ["CRASHED", "CRASHED", "COMPLETED"]  # the lost run is marked, not left Running


@pytest.mark.timeout(60)
def test_preempt_gpu_step_failed_run_is_not_run_again(gpu_step):
    config, _, start = gpu_step
    worker = start(["fail", "complete"])
    with pytest.raises(DeploymentRunFailed, match=r"ended Failed: ValueError: a bug \(not run again"):
        train_remote(config, 1, attempts=3, poll_s=0.1)
    assert worker.states() == ["FAILED"]


@pytest.mark.timeout(60)
def test_preempt_gpu_step_gives_up_after_the_bound_counting_attempts(gpu_step):
    config, store, start = gpu_step
    worker = start(["crash", "crash", "complete"])
    with pytest.raises(DeploymentRunCrashed, match=r"crashed 2 times \(attempt 2 of 2\)"):
        train_remote(config, 1, attempts=2, poll_s=0.1)
    assert worker.states() == ["CRASHED", "CRASHED"] and training_result(store, 1) is None
