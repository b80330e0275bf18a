"""Forking a run (storage/fork.py, `trajflow fork`): a new run from one committed step, sharing no file with its
source, on a local folder and on S3 (moto)."""

from __future__ import annotations

import pytest

from flows.cli import main
from storage import RunStore
from storage.fork import ForkError, fork_run
from storage.lease import RunLease

HEAVY = ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "trainer/state.pt")


def _source(root: str, steps: int = 3) -> RunStore:
    store = RunStore(root, "proj", "src")
    for step in range(steps):
        for rel in HEAVY:
            store.put_bytes(step, rel, f"{rel}@{step}".encode())
        store.put_bytes(step, "training.json", b'{"probe": %d}' % step)
        store.put_bytes(step, "scored.parquet", f"traj@{step}".encode())
        if step == 0:
            store.write_run_config({"project": "proj", "run": "src", "base_model": "tiny-random", "seed": 7})
        store.commit(step, {"train/reward": 0.1 * step}, {"policy": f"src@{step}"})
    return store


def test_fork_copies_the_step_records_provenance_and_outlives_the_source(store_root):
    source = _source(store_root)
    dest = RunStore(store_root, "proj", "new")
    result = fork_run(source, dest, step=1)

    assert result.step == 1 and dest.committed_steps() == [1]
    for rel in [*HEAVY, "training.json", "scored.parquet"]:
        assert dest.get_bytes(1, rel, verify=True) == source.get_bytes(1, rel)
    record = dest.read_run_config()
    assert record["run"] == "new" and record["seed"] == 7 and record["base_model"] == "tiny-random"
    assert record["forked_from"] == {**result.forked_from, "run": "src", "step": 1}
    manifest = dest.read_manifest(1)
    assert manifest.extra["policy"] == "new@1" and manifest.extra["forked_from"]["run"] == "src"
    assert manifest.metrics == source.read_manifest(1).metrics

    # the source's retention leaves the fork whole: nothing is shared
    assert source.apply_retention(keep_last=1) == [0, 1]
    assert not source.exists(1, HEAVY[0])
    assert dest.get_bytes(1, HEAVY[0], verify=True) == b"adapter/adapter_model.safetensors@1"

    # a second fork takes the latest step that still has its checkpoint
    assert fork_run(source, RunStore(store_root, "proj", "latest")).step == 2
    with pytest.raises(ForkError, match=r"no longer has its adapter and trainer state \(pruned by retention\); "
                                        r"steps that have them: \[2\]"):
        fork_run(source, RunStore(store_root, "proj", "again"), step=1)


def test_fork_refusals(store_root):
    source = _source(store_root, steps=2)
    with pytest.raises(ForkError, match=r"step 5 of proj/src is not committed; committed steps: \[0, 1\]"):
        fork_run(source, RunStore(store_root, "proj", "x"), step=5)
    with pytest.raises(ForkError, match="at or before step 0"):
        source.apply_retention(keep_last=1)
        fork_run(source, RunStore(store_root, "proj", "y"), not_after_step=0)
    with pytest.raises(ForkError, match="into itself"):
        fork_run(source, source, step=1)
    with pytest.raises(ForkError, match="no committed step"):
        fork_run(RunStore(store_root, "proj", "ghost"), RunStore(store_root, "proj", "z"))
    trained = RunStore(store_root, "proj", "trained")
    fork_run(source, trained, step=1)
    with pytest.raises(ForkError, match=r"already has committed steps \[1\]"):
        fork_run(source, trained, step=1)
    assert RunStore(store_root, "proj", "x").committed_steps() == []


def test_fork_into_a_registered_untrained_run(store_root):
    source = _source(store_root)
    fresh = RunStore(store_root, "proj", "fresh")
    fresh.put_bytes(0, HEAVY[0], b"own step 0")
    fresh.write_run_config({"project": "proj", "run": "fresh", "base_model": "tiny-random", "seed": 7, "mine": 1})
    fresh.commit(0, {}, {"policy": "fresh@0"})
    assert fork_run(source, fresh, not_after_step=2).step == 2
    assert fresh.committed_steps() == [0, 2] and fresh.read_run_config()["mine"] == 1
    assert fresh.get_bytes(0, HEAVY[0]) == b"own step 0"


def test_trajflow_fork_command(store_root, capsys):
    _source(store_root)
    assert main(["fork", "src@1", "cli-new", "--project", "proj", "--storage", store_root]) == 0
    out = capsys.readouterr().out
    assert "forked proj/src@1 into proj/cli-new" in out and "--set run=cli-new" in out
    assert RunStore(store_root, "proj", "cli-new").committed_steps() == [1]
    assert main(["fork", "src", "cli-latest", "--project", "other", "--from-project", "proj",
                 "--storage", store_root]) == 0
    assert RunStore(store_root, "other", "cli-latest").committed_steps() == [2]


def test_trajflow_fork_waits_for_no_one_but_refuses_a_run_in_use(tmp_path, capsys):
    root = str(tmp_path / "runs")
    _source(root)
    lease = RunLease(RunStore(root, "proj", "busy"), "another trainer").acquire()
    try:
        assert main(["fork", "src@1", "busy", "--project", "proj", "--storage", root]) == 2
    finally:
        lease.release()
    err = capsys.readouterr().err
    assert err.startswith("trajflow fork: error: ") and "another trainer" in err and err.count("\n") == 1
