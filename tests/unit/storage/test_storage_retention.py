"""Retention: keep the latest N committed steps plus the best by a metric; never the newest; trajectories stay."""

from __future__ import annotations

import math

import pytest

from storage import NotFoundError, RunStore
from storage.manifest import StepManifest
from storage.retention import steps_to_keep

HEAVY = ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "trainer/optimizer.pt")


def _commit_steps(store: RunStore, rewards: list[float]) -> None:
    for step, reward in enumerate(rewards):
        for rel in HEAVY:
            store.put_bytes(step, rel, f"{rel}@{step}".encode())
        store.put_bytes(step, "trajectories.parquet", f"traj@{step}".encode())
        store.commit(step, {"reward": reward, "loss": -reward}, {"policy": f"m@{step}"})


def test_latest_n_plus_best_are_kept(store_root, raw_storage, tmp_path):
    store = RunStore(store_root, "proj", "run")
    _commit_steps(store, [0.1, 0.9, 0.2, 0.3, 0.4, 0.5])

    assert store.apply_retention(keep_last=2, best_metric="reward", mode="max") == [0, 2, 3]

    fresh = RunStore(store_root, "proj", "run")
    assert fresh.committed_steps() == [0, 1, 2, 3, 4, 5]
    for step in (1, 4, 5):
        manifest = fresh.read_manifest(step)
        assert not manifest.pruned
        assert sorted(manifest.files) == sorted([*HEAVY, "trajectories.parquet"])
        fresh.download_folder(step, "adapter", tmp_path / f"a{step}")
    for step in (0, 2, 3):
        manifest = fresh.read_manifest(step)
        assert manifest.pruned and manifest.pruned_prefixes == ["adapter/", "trainer/"]
        assert list(manifest.files) == ["trajectories.parquet"]
        assert manifest.metrics == {"reward": [0.1, 0.9, 0.2, 0.3][step], "loss": -[0.1, 0.9, 0.2, 0.3][step]}
        assert manifest.extra == {"policy": f"m@{step}"}
        assert fresh.list_files(step) == ["trajectories.parquet"]
        assert fresh.get_bytes(step, "trajectories.parquet", verify=True) == f"traj@{step}".encode()
        with pytest.raises(NotFoundError, match=rf"steps/0000{step}/adapter: .*records no files .*pruned by retention"):
            fresh.download_folder(step, "adapter", tmp_path / f"gone{step}")
    assert not any(k.startswith("proj/run/steps/00000/adapter") for k in raw_storage.keys())

    # idempotent; later steps push older ones out while the best stays
    assert fresh.apply_retention(keep_last=2, best_metric="reward") == []
    store.put_bytes(6, "adapter/adapter_model.safetensors", b"w6")
    store.commit(6, {"reward": 0.6})
    assert store.apply_retention(keep_last=2, best_metric="reward") == [4]
    assert not store.read_manifest(1).pruned


def test_min_mode_and_custom_prefixes(store_root):
    store = RunStore(store_root, "proj", "run")
    _commit_steps(store, [0.5, 0.2, 0.8, 0.1])  # loss = -reward: lowest loss at step 2
    assert store.apply_retention(keep_last=1, best_metric="loss", mode="min", prune=("trainer/",)) == [0, 1]
    assert sorted(store.read_manifest(0).files) == sorted(["adapter/adapter_model.safetensors", "adapter/adapter_config.json", "trajectories.parquet"])
    assert not store.read_manifest(2).pruned


def test_newest_step_is_never_pruned(store_root):
    store = RunStore(store_root, "proj", "run")
    _commit_steps(store, [0.9, 0.1, 0.2])
    assert store.apply_retention(keep_last=0, best_metric="reward") == [1]
    assert not store.read_manifest(2).pruned  # the newest, although neither best nor in keep_last
    assert store.apply_retention(keep_last=0) == [0]
    assert "adapter/adapter_model.safetensors" in store.read_manifest(2).files


def test_uncommitted_steps_are_left_alone(store_root):
    store = RunStore(store_root, "proj", "run")
    _commit_steps(store, [0.1, 0.2])
    store.put_bytes(2, "adapter/adapter_model.safetensors", b"in progress")  # not committed yet
    assert store.apply_retention(keep_last=1) == [0]
    assert store.get_bytes(2, "adapter/adapter_model.safetensors") == b"in progress"


def test_files_left_by_a_crash_during_pruning_are_removed_next_time(store_root, raw_storage):
    store = RunStore(store_root, "proj", "run")
    _commit_steps(store, [0.1, 0.2, 0.3])
    assert store.apply_retention(keep_last=1) == [0, 1]
    # as if the process died after rewriting the manifest but before deleting this file
    raw_storage.write("proj/run/steps/00000/adapter/adapter_model.safetensors", b"orphan")
    assert store.apply_retention(keep_last=1) == [0]
    assert store.list_files(0) == ["trajectories.parquet"]


def _manifest(step: int, **metrics: float) -> StepManifest:
    return StepManifest(step=step, created_at="2026-01-01T00:00:00Z", trajflow_version="test", metrics=metrics)


def test_policy_ties_missing_values_and_bad_arguments():
    ms = {s: _manifest(s, reward=r) for s, r in enumerate([0.5, 0.9, 0.9, math.nan, 0.1])}
    assert steps_to_keep(ms, 1, "reward") == {1, 4}  # tie: the earliest best; NaN never best
    assert steps_to_keep(ms, 1, "reward", "min") == {4}
    assert steps_to_keep(ms, 2, "absent") == {3, 4}
    assert steps_to_keep({}, 3, "reward") == set()
    with pytest.raises(ValueError, match="keep_last must be an integer >= 0"):
        steps_to_keep(ms, -1)
    with pytest.raises(ValueError, match="mode must be 'max' or 'min'"):
        steps_to_keep(ms, 1, "reward", "best")
