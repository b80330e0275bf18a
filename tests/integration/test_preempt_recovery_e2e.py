"""Spot preemption recovered without a human: a real Prefect server, `trajflow deploy`, process workers, three kills.

Set-up, as a user does it (README "Deploying"): `prefect server start` (SQLite), `trajflow deploy` (pools, the
deployments of prefect.yaml with the recover trigger, the zombie automation), `prefect worker start --pool
cpu-pool`, then a run of `train/ui` with a tiny config (tiny-random, the echo agent, rollouts through a counting
proxy that answers the first group of step 1 and holds the next, so every kill lands mid-rollout). Then:

(a) SIGKILL of the flow-run process while its worker lives: the worker reports it Crashed;
(b) SIGKILL of the worker and the flow-run process together (the machine is gone), then a new worker: nothing
    reports anything, the zombie automation marks the run Crashed once its heartbeats stop;
(c) SIGTERM mid-rollout: the flow stops at once, releases its lease and ends Crashed.

Each time, with no human action: the `recover` flow runs the deployment again with the same parameters, the new
run resumes from storage and completes; every committed step is committed once (its manifest never rewritten), no
stored rollout group is sampled again (the proxy sees requests only for the groups that were not stored, and no
stored group file is rewritten), the crash and the decision are recorded in the run's storage.

Each scenario runs its own copy of `train/ui` (same flow, parameters, work pool, pull steps and concurrency limit
of 1), so the three run at once: on the one `train/ui` they queued for its one slot (two thirds of the test's time),
while each copy still makes its recovered run wait for the slot its crashed run held, so every kind of crash must
free it. Shortened for the test: worker polling (1 s; Prefect's default 10 s), the zombie window (45 s: one missed
heartbeat and a half; the deployed default is 3 x 30 s) and the recover back-off (TRAJFLOW_PREEMPT_BACKOFF_S,
1 s; prefect.yaml's 10 s). `benchmarks/preemption.py` runs this module with the production back-off and writes
the timings to benchmarks/results/preemption.json (TRAJFLOW_PREEMPTION_RESULTS).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from storage.layout import GROUPS_DIR, RUN_LEASE, STEPS_DIR
from storage.recoveries import recovery_history
from storage.store import RunStore
from tests.fixtures_prefect_server import Worker, prefect_env
from tests.paths import REPO

GROUPS, GROUP_SIZE, STEPS = 3, 2, 2
SILENT_AFTER_S = 45
BACKOFF_S = float(os.environ.get("TRAJFLOW_PREEMPT_BACKOFF_S", "1"))
RESULTS_ENV = "TRAJFLOW_PREEMPTION_RESULTS"
WORKER_ENV = {"PREFECT_WORKER_QUERY_SECONDS": "1"}
QUEUES = ("default", "spot")  # (b) runs alone on `spot`, so losing its machine leaves the others running
SERIAL_ENV = "TRAJFLOW_PREEMPT_SERIAL"  # 1: one scenario at a time (the benchmark's timings); else all at once


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _trajflow(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], check=False, cwd=REPO, capture_output=True, text=True,
                          env=prefect_env(server.url, server.root / "cli-home", TRAJFLOW_HOME=str(REPO)),
                          timeout=300)


class Cluster:
    """The deployed server, the current cpu-pool worker (a 'machine'), and a client bound to the server."""

    def __init__(self, server, proxy, root: Path):
        self.server, self.proxy, self.root = server, proxy, root
        self.machines = 0
        self.workers = {queue: self.new_machine(queue) for queue in QUEUES}

    def new_machine(self, queue: str) -> Worker:
        """A worker on `queue` of cpu-pool: one machine of the pool."""
        self.machines += 1
        return Worker(self.server, f"machine-{self.machines}", "cpu-pool", queue, **WORKER_ENV)

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.kill()

    @staticmethod
    def client():
        from prefect.client.orchestration import get_client

        return get_client(sync_client=True)

    def start_run(self, run: str, deployment: str, queue: str):
        config = {"project": "ci", "run": run, "agent": "tests.flow_agents:EchoAgent", "base_model": "tiny-random",
                  "storage": str(self.root), "seed": 0, "steps": STEPS, "group_size": GROUP_SIZE,
                  "groups_per_step": GROUPS, "eval_every": 0,
                  "inference": {"backend": "url", "url": f"{self.proxy.url}/v1"},
                  "rollouts": {"concurrency": GROUP_SIZE, "timeout_s": 60},  # groups finish one after another
                  "trainer": {"learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8}}
        with self.client() as client:
            found = client.read_deployment_by_name(f"train/{deployment}")
            return client.create_flow_run_from_deployment(found.id, parameters={"config": config},
                                                          work_queue_name=queue)

    def read_run(self, run_id):
        with self.client() as client:
            return client.read_flow_run(run_id)


def _copy_deployment(client, source: str, name: str) -> None:
    """A deployment `name` of the same flow as `source` (flow/deployment), with everything a run depends on."""
    found = client.read_deployment_by_name(source)
    limit = found.global_concurrency_limit.limit if found.global_concurrency_limit else found.concurrency_limit
    client.create_deployment(
        flow_id=found.flow_id, name=name, concurrency_limit=limit, concurrency_options=found.concurrency_options,
        parameters=found.parameters, description=found.description, work_pool_name=found.work_pool_name,
        work_queue_name=found.work_queue_name, tags=found.tags, path=found.path, entrypoint=found.entrypoint,
        parameter_openapi_schema=found.parameter_openapi_schema, pull_steps=found.pull_steps,
        enforce_parameter_schema=found.enforce_parameter_schema, job_variables=found.job_variables)
    copy = client.read_deployment_by_name(f"{source.split('/')[0]}/{name}")
    assert limit == 1 and copy.global_concurrency_limit.limit == limit, (limit, copy.global_concurrency_limit)


@pytest.fixture(scope="module")
def cluster(prefect_server, counting_server, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deploys = [_trajflow(prefect_server, "deploy", "--silent-after-s", str(SILENT_AFTER_S)) for _ in range(2)]
    for done in deploys:
        assert done.returncode == 0, done.stdout + done.stderr
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.url}):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import DeploymentUpdate

        with get_client(sync_client=True) as client:
            recover = client.read_deployment_by_name("recover/on-crash")
            client.update_deployment(recover.id, DeploymentUpdate(parameters={"attempts": 3, "backoff_s": BACKOFF_S}))
            client.create_work_queue(name="spot", work_pool_name="cpu-pool")
            for deployment in {deployment for _, deployment, _, _, _ in SCENARIOS.values()} - {"ui"}:
                _copy_deployment(client, "train/ui", deployment)
        cluster = Cluster(prefect_server, counting_server, tmp_path_factory.mktemp("runs"))
    cluster.deploys = [done.stdout for done in deploys]
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.url}):
        yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def results():
    found: dict[str, dict] = {}
    yield found
    target = os.environ.get(RESULTS_ENV)
    if target and found:
        Path(target).write_text(json.dumps(found, indent=2) + "\n")


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run's steps: relative path -> (inode, mtime_ns); a rewrite changes one of them."""
    return {str(p.relative_to(run_dir)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (run_dir / STEPS_DIR).rglob("*") if p.is_file()}


def _first_write_after(run_dir: Path, t: float) -> float | None:
    """The earliest modification time after `t` of a file of the run's steps (the first new durable write)."""
    times = [p.stat().st_mtime for p in (run_dir / STEPS_DIR).rglob("*") if p.is_file() and p.stat().st_mtime > t]
    return min(times) if times else None


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _scenario(cluster: Cluster, run: str, deployment: str, queue: str, kill) -> dict:
    """Start `run` of train/`deployment` on `queue`, stop it mid-rollout of step 1 with `kill(pid)`, wait for its
    recovery; check and time it."""
    proxy, model = cluster.proxy, f"{run}@0"
    proxy.hold_rollouts_after(model, GROUP_SIZE)
    store = RunStore(str(cluster.root), "ci", run)
    run_dir = Path(cluster.root) / "ci" / run
    first = cluster.start_run(run, deployment, queue)
    _wait_for(lambda: len(store.list_files(1, GROUPS_DIR + "/")) == 1, 240, "the first group of step 1")
    _wait_for(lambda: len(proxy.rollout_requests(model)) == 2 * GROUP_SIZE, 60, "the next group in flight")
    pid = json.loads((run_dir / RUN_LEASE).read_text())["pid"]
    before = _files(run_dir)
    killed_at = time.time()
    kill(pid)
    _wait_for(lambda: _pid_gone(pid), 60, f"the flow-run process {pid} to end")
    requests_before_kill = len(proxy.rollout_requests(model))
    proxy.release(model)  # held requests fail; from here on every request is the recovered run's

    records = _wait_for(lambda: [r for r in recovery_history(store) if r.flow_run_id == str(first.id)],
                        SILENT_AFTER_S + 120, "the recover flow's record of the crash", interval=0.5)
    record = records[0]
    assert record.decision == "rerun" and record.attempt == 1 and record.committed_step == 0, record
    _wait_for(lambda: store.latest_step() == STEPS, 240, f"step {STEPS} committed by the recovered run", 0.5)
    recovered = _wait_for(lambda: (r := cluster.read_run(record.new_flow_run_id)).state.is_final() and r,
                          60, "the recovered flow run to end", 0.5)
    crashed = cluster.read_run(first.id)

    assert crashed.state.is_crashed(), f"the killed run ended {crashed.state.type}: {crashed.state.message}"
    assert recovered.state.is_completed(), f"the recovered run ended {recovered.state.type}: {recovered.state.message}"
    assert "recovered" in recovered.tags and recovered.parameters == first.parameters
    after = _files(run_dir)
    rewritten = sorted(path for path, stat in before.items() if after.get(path) != stat)
    assert rewritten == [], f"files written before the kill were rewritten or removed: {rewritten}"
    assert store.committed_steps() == list(range(STEPS + 1))
    stored_at_kill = sum(1 for path in before if f"/{GROUPS_DIR}/" in path and path.startswith(f"{STEPS_DIR}/00001"))
    resampled_requests = (len(proxy.rollout_requests(model)) - requests_before_kill
                          - (GROUPS - stored_at_kill) * GROUP_SIZE)
    assert stored_at_kill == 1 and resampled_requests == 0, (stored_at_kill, proxy.rollout_requests(model))
    assert len(recovery_history(store)) == 1  # one crash, handled once (a duplicate event finds the record)
    first_write = _first_write_after(run_dir, killed_at)
    return {
        "run": run,
        "killed_at": killed_at,
        "crashed_state_message": crashed.state.message,
        "crash_marked_s": round(crashed.state.timestamp.timestamp() - killed_at, 2),
        "rerun_scheduled_in_s": record.delay_s,
        "recovered_run_started_s": round(recovered.start_time.timestamp() - killed_at, 2),
        "recovery_s": round(first_write - killed_at, 2),
        "requests_in_flight_at_kill": requests_before_kill - GROUP_SIZE,
        "groups_stored_at_kill": stored_at_kill,
        "groups_resampled": len([p for p in rewritten if f"/{GROUPS_DIR}/" in p]) + resampled_requests // GROUP_SIZE,
        "steps_committed": store.committed_steps(),
        "completed": recovered.state.is_completed(),
    }


def test_preempt_deploy_is_one_idempotent_command(cluster):
    first, again = cluster.deploys
    for line in ("work pool cpu-pool: created", "work pool gpu-pool: created", "concurrency limit gpu: created (1)",
                 "train/ui, train/nightly, train-step/gpu, recover/on-crash",
                 f"(silent for {SILENT_AFTER_S} s -> Crashed): created"):
        assert line in first, first
    for line in ("work pool cpu-pool: kept", "concurrency limit gpu: kept (1)", "Crashed): unchanged"):
        assert line in again, again
    with cluster.client() as client:
        names = sorted(a.name for a in client.read_automations())
    assert names == ["trajflow: crash runs whose heartbeats stopped", "trajflow: run crashed training runs again"]


def _kill(sig: int):
    return lambda cluster, pid: os.kill(pid, sig)


def _lose_the_machine(cluster: Cluster, pid: int) -> None:
    """Worker and flow-run process SIGKILLed together; the spot pool then gives a new machine."""
    cluster.workers["spot"].kill()
    os.kill(pid, signal.SIGKILL)
    cluster.workers["spot"] = cluster.new_machine("spot")


SCENARIOS = {  # result key: (run, deployment of train, queue, kill, what the crashed state's message must say)
    "worker_alive": ("preempt-a", "ui", "default", _kill(signal.SIGKILL), "SIGKILL"),
    "machine_lost": ("preempt-b", "ui-spot", "spot", _lose_the_machine, "no heartbeat"),  # only the zombie saw it
    "sigterm": ("preempt-c", "ui-sigterm", "default", _kill(signal.SIGTERM), "termination signal"),
}


@pytest.mark.timeout(900)
def test_preempt_three_kills_each_recovered_without_a_human(cluster, results):
    outcomes: dict[str, object] = {}

    def play(key: str) -> None:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        run, deployment, queue, kill, _ = SCENARIOS[key]
        try:
            with temporary_settings(updates={PREFECT_API_URL: cluster.server.url}):  # settings are per thread
                outcomes[key] = _scenario(cluster, run, deployment, queue, lambda pid: kill(cluster, pid))
        except BaseException as exc:  # noqa: BLE001 - reported below with the others
            outcomes[key] = "".join(traceback.format_exception(exc))

    threads = [threading.Thread(target=play, args=(key,)) for key in SCENARIOS]
    for thread in threads:
        thread.start()
        if os.environ.get(SERIAL_ENV) == "1":
            thread.join()
    for thread in threads:
        thread.join()
    failed = {key: value for key, value in outcomes.items() if isinstance(value, str)}
    assert not failed, "\n".join(f"--- {key}:\n{value}" for key, value in failed.items())
    for key, (_, _, _, _, said) in SCENARIOS.items():
        assert said in outcomes[key]["crashed_state_message"], outcomes[key]
        results[key] = outcomes[key]
    assert outcomes["sigterm"]["crash_marked_s"] < 20, outcomes["sigterm"]
