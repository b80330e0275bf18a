"""SIGTERM mid-rollout (a spot reclaim): the training flow stops at once, cleanly, and a rerun redoes nothing.

The flow is a process of its own (forked, tests/fixtures_launcher.py) reporting to the session's Prefect API.
The proxy answers the first group of step 1 and holds the others, so the SIGTERM finds requests in flight.
Asserted: the process logs "preempted at step 1" and ends by SIGTERM well inside a grace period; Prefect marks
its flow run Crashed (what an automation reruns), not Failed; the run's lease is released (the next start
takes over at once, not after the TTL); no temporary or partial file is left; the rerun requests only the
groups that were not stored and completes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from storage.lease import RunLease
from storage.store import RunStore
from tests.fixtures_resume import train_invocation
from tests.paths import REPO

GROUPS, GROUP_SIZE, STEPS = 3, 3, 1


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _latest_train_run_state(started_after: float):
    """The state of the newest `train` flow run created after `started_after` (epoch seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=5)
    runs = [r for r in runs if r.created and r.created.timestamp() >= started_after - 5]
    assert runs, "no train flow run reached the Prefect API"
    return runs[0].state


@pytest.mark.timeout(300)
def test_preempt_sigterm_mid_rollout_stops_cleanly_and_resumes_without_resampling(
        counting_server, prefect_api, fork_launcher, tmp_path):
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    root = str(tmp_path / "runs")
    store = RunStore(root, "ci", "tiny")
    proxy = counting_server

    proxy.reset()
    proxy.hold_rollouts_after("tiny@0", GROUP_SIZE)
    argv, env, log_path = train_invocation(root, proxy.url, tmp_path, None, None, api,
                                           steps=STEPS, groups=GROUPS, group_size=GROUP_SIZE)
    started = time.time()
    pid = fork_launcher.start(argv, env, REPO, log_path)
    try:
        _wait_for(lambda: len(store.list_files(1, "groups/")) == 1, 180,
                  "the first group of step 1")
        _wait_for(lambda: len(proxy.rollout_requests("tiny@0")) == 2 * GROUP_SIZE, 30,
                  "the next group's requests in flight (concurrency: one group)")
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        code = fork_launcher.wait(pid, timeout=60)
        stop_s = time.monotonic() - sent
    except (AssertionError, subprocess.TimeoutExpired):
        os.killpg(pid, signal.SIGKILL)
        raise
    out = log_path.read_text()
    assert code == -signal.SIGTERM, out[-3000:]
    assert "preempted at step 1" in out, out[-3000:]
    assert stop_s < 20, f"took {stop_s:.1f} s to stop after SIGTERM"
    state = _latest_train_run_state(started)
    assert state.is_crashed(), f"flow run ended {state.type}: {state.message}"

    # nothing half-written: one whole group, no temporary file, no step committed, the lease gone
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert not [p for p in files if ".tmp-" in p.name], files
    assert len(store.list_files(1, "groups/")) == 1 and store.committed_steps() == [0]
    assert RunLease(store, "check").holder() is None

    # the rerun takes over at once and samples only the two groups that were not stored
    proxy.reset()
    argv, env, log_path = train_invocation(root, proxy.url, tmp_path, None, None, api,
                                           steps=STEPS, groups=GROUPS, group_size=GROUP_SIZE)
    code = fork_launcher.run(argv, env, REPO, log_path, timeout=240)
    assert code == 0, log_path.read_text()[-3000:]
    assert len(proxy.rollout_requests("tiny@0")) == (GROUPS - 1) * GROUP_SIZE
    assert store.committed_steps() == [0, 1]
