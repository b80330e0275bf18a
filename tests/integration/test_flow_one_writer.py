"""One writer per run, on the flow side: the run's lease (storage/lease.py) and when ``run.json`` is written.

A second `trajflow train` on a run another process trains stops at once and names the holder; a run whose
holder was preempted (stopped renewing) is taken over after its lease expires; a first start that fails
before step 0 exists leaves the run name free. Kill-and-resume on the same host is tests/integration/test_resume.py.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from storage.layout import RUN_CONFIG, RUN_LEASE
from storage.lease import RunLease, RunLeaseHeldError
from storage.store import RunStore
from tasks.run_config import load_config
from tests.paths import REPO

SETS = ["agent=tests.flow_agents:EchoAgent", "steps=0", "groups_per_step=2", "group_size=3"]


def _config(root, *sets):
    return load_config("configs/tiny.yaml", [f"storage={root}", *SETS, *sets])


def test_a_second_train_on_a_held_run_stops_at_once_naming_the_holder(prefect_api, tmp_path, tiny_model_path,
                                                                     fork_launcher):
    from flows.train import train

    root = tmp_path / "runs"
    config = _config(root)
    store = RunStore(str(root), "ci", "tiny")
    holder = RunLease(store, "trajflow train", ttl_s=120).acquire()  # this test process trains the run
    try:
        log = tmp_path / "second.log"
        env = {k: v for k, v in os.environ.items() if k != "TRAJFLOW_CRASH_AT"}
        started = time.monotonic()
        code = fork_launcher.run(["-m", "flows.train", "configs/tiny.yaml", *[a for s in SETS for a in ("--set", s)],
                                  "--set", f"storage={root}"], env, REPO, log, timeout=120)
        out = log.read_text()
        assert code == 1, out[-3000:]
        assert time.monotonic() - started < 30  # before Prefect starts
        assert f"trajflow train: error: run ci/tiny ({root}/ci/tiny) is in use by trajflow train (pid {os.getpid()}, " \
               f"host {socket.gethostname()})" in out
        assert "expires" in out and "Traceback" not in out
        # the flow itself refuses too (a deployment run does not pass through the command line)
        with pytest.raises(RunLeaseHeldError, match=f"pid {os.getpid()}"):
            train(config)
        assert store.list_files(None) == [] and store.committed_steps() == [] and store.read_run_config() is None
    finally:
        holder.release()
    assert train(config)["step"] == 0
    assert not (root / "ci" / "tiny" / RUN_LEASE).exists()  # released at the end of the flow


def test_a_preempted_run_is_taken_over_once_its_lease_expired(prefect_api, tmp_path, tiny_model_path, caplog):
    from flows.train import train

    config = _config(tmp_path / "runs")
    store = RunStore(config.storage, "ci", "tiny")
    now = time.time()
    stale = {"owner": "node-7:4242:0", "host": "node-7", "pid": 4242, "purpose": "trajflow train",
             "acquired_at": now - 600, "renewed_at": now - 100, "expires_at": now + 1.5}
    lease_file = tmp_path / "runs" / "ci" / "tiny" / RUN_LEASE
    lease_file.parent.mkdir(parents=True)
    lease_file.write_text(json.dumps(stale))
    with pytest.raises(RunLeaseHeldError, match="host node-7"):
        train(config)
    time.sleep(max(0.0, stale["expires_at"] - time.time()) + 0.2)
    assert train(config)["step"] == 0
    assert "taking over the lease" in caplog.text and store.committed_steps() == [0]


def test_a_failed_first_start_leaves_the_run_name_free(prefect_api, tmp_path, tiny_model_path):
    from flows.train import train

    with pytest.raises(ValueError, match="unknown model 'tiny-randon'"):
        train(_config(tmp_path / "runs", "base_model=tiny-randon"))
    run_dir = tmp_path / "runs" / "ci" / "tiny"
    assert not (run_dir / RUN_CONFIG).exists() and not (run_dir / RUN_LEASE).exists()
    store = RunStore(str(tmp_path / "runs"), "ci", "tiny")
    assert train(_config(tmp_path / "runs"))["step"] == 0  # the corrected command is not refused
    assert store.read_run_config()["base_model"] == "tiny-random"
