"""A corrupt manifest.json commits nothing, for every reader alike: it is moved aside and the step is redone.

Before, listings skipped such a step while reads and downloads raised on it, so a resumed run retrained
the step and then failed to publish it on every rerun. Local folder and S3 (moto).
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from storage import CorruptManifestError, NotFoundError, RunStore, StorageError
from storage.fs import Location
from storage.runs import list_runs

MANIFEST_1 = "proj/run/steps/00001/manifest.json"


def _commit_steps(store: RunStore, steps=(0, 1)) -> None:
    for step in steps:
        store.put_bytes(step, "adapter/adapter_model.safetensors", f"weights {step}".encode())
        store.put_bytes(step, "scored.parquet", f"groups {step}".encode())
        store.commit(step, {"reward": float(step)})


CAUSES = {
    "truncated": r"not valid JSON \(truncated or overwritten\?\)",
    "empty": "the file is empty",
    "not UTF-8": "not valid JSON",
    "wrong shape": "invalid field.*created_at: Field required",
    "another step's": "it records step 0, its folder is step 1",
    "a path escaping the step": r"invalid relative path '\.\./\.\./\.\./escape\.txt'",
}


def _damages(raw_storage) -> dict[str, bytes]:
    good = raw_storage.read(MANIFEST_1)
    forged = json.loads(good)
    forged["files"]["../../../escape.txt"] = forged["files"].pop("scored.parquet")
    return {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "not UTF-8": b"\xff\xfe" + good[2:],
        "wrong shape": b'{"format": 1, "step": 1}',
        "another step's": good.replace(b'"step": 1', b'"step": 0'),
        "a path escaping the step": json.dumps(forged).encode(),
    }


def _aside(raw_storage, step: int = 1) -> list[str]:
    name = rf"proj/run/steps/{step:05d}/manifest\.json\.corrupt-\d{{8}}T\d{{12}}Z"
    return [k for k in raw_storage.keys() if re.fullmatch(name, k)]  # noqa: SIM118 - RawStorage.keys() is a list


# each reader, called alone on a store that has just found the corrupt manifest
READERS = {
    "committed_steps": lambda s, tmp: s.committed_steps(),
    "latest_step": lambda s, tmp: s.latest_step(),
    "is_committed": lambda s, tmp: s.is_committed(1),
    "read_manifest": lambda s, tmp: s.read_manifest(1),
    "download_folder (publish, checkpoints)": lambda s, tmp: s.download_folder(1, "adapter", tmp / "adapter"),
    "get_bytes with verify": lambda s, tmp: s.get_bytes(1, "scored.parquet", verify=True),
    "put_bytes to the step": lambda s, tmp: s.put_bytes(1, "late.txt", b"late"),
    "amend_metrics": lambda s, tmp: s.amend_metrics(1, {"val/reward": 1.0}),
    "apply_retention": lambda s, tmp: s.apply_retention(1),
    "list_runs (trajflow runs)": lambda s, tmp: list_runs(s.root),
}


CASES = [(reader, "truncated") for reader in READERS] + [
    ("read_manifest", damage) for damage in ("empty", "not UTF-8", "wrong shape", "another step's",
                                             "a path escaping the step")]


@pytest.mark.parametrize("reader, damage", CASES, ids=[f"{r}-{d}" for r, d in CASES])
def test_every_reader_moves_it_aside_and_then_all_agree_the_step_is_not_committed(
        store_root, raw_storage, tmp_path, caplog, reader, damage):
    _commit_steps(RunStore(store_root, "proj", "run"))
    corrupt = _damages(raw_storage)[damage]
    raw_storage.write(MANIFEST_1, corrupt)

    store = RunStore(store_root, "proj", "run")
    with caplog.at_level(logging.WARNING, logger="trajflow.storage"):
        try:
            READERS[reader](store, tmp_path)
        except NotFoundError as exc:  # the readers of one step say it is not committed
            assert reader in ("read_manifest", "amend_metrics"), exc
            assert "step 1 is not committed" in str(exc)
    # moved aside, bytes intact, with a logged reason naming the file
    aside = _aside(raw_storage)
    assert len(aside) == 1 and raw_storage.read(aside[0]) == corrupt
    assert MANIFEST_1 not in raw_storage.keys()
    assert "step 1 is not committed, it will be redone: corrupt manifest" in caplog.text
    assert re.search(CAUSES[damage], caplog.text), caplog.text
    assert f"{store_root}/proj/run/steps/00001/manifest.json" in caplog.text and "moved aside to" in caplog.text

    # every reader, in this process or another, now agrees
    for fresh in (store, RunStore(store_root, "proj", "run")):
        assert fresh.committed_steps() == [0] and fresh.latest_step() == 0 and not fresh.is_committed(1)
        with pytest.raises(NotFoundError, match="step 1 is not committed"):
            fresh.read_manifest(1)
        assert "manifest.json.corrupt" not in " ".join(fresh.list_files(1))
    assert [r.steps for r in list_runs(store_root)] == [[0]]
    # the step's files are still there, unverified, for the run that redoes it
    out = store.download_folder(1, "adapter", tmp_path / "again")
    assert (out / "adapter_model.safetensors").read_bytes() == b"weights 1"

    # redoing the step commits it; the quarantined copy is not one of its files
    manifest = store.commit(1, {"reward": 1.0})
    assert "late.txt" in manifest.files if reader == "put_bytes to the step" else "late.txt" not in manifest.files
    assert not any("corrupt" in f for f in manifest.files)
    assert RunStore(store_root, "proj", "run").committed_steps() == [0, 1]


def test_a_manifest_committed_meanwhile_is_put_back(store_root, raw_storage, monkeypatch):
    """A commit may replace the corrupt manifest between the reader's read and its move: that one stays."""
    _commit_steps(RunStore(store_root, "proj", "run"))
    good = raw_storage.read(MANIFEST_1)
    raw_storage.write(MANIFEST_1, good[:40])
    real_move = Location.move

    def move_after_a_commit(self, rel, new_rel):
        raw_storage.write(MANIFEST_1, good)  # the other writer's commit lands first
        return real_move(self, rel, new_rel)

    monkeypatch.setattr(Location, "move", move_after_a_commit)
    store = RunStore(store_root, "proj", "run")
    assert store.committed_steps() == [0]  # what it read was corrupt
    monkeypatch.undo()
    assert raw_storage.read(MANIFEST_1) == good and _aside(raw_storage) == []
    assert store.committed_steps() == [0, 1]


def test_a_manifest_that_cannot_be_moved_still_commits_nothing(store_root, raw_storage, monkeypatch, caplog):
    """Read-only credentials, say: the step is still not committed, and the next commit replaces it in place."""
    _commit_steps(RunStore(store_root, "proj", "run"))
    raw_storage.write(MANIFEST_1, b"{")

    def refuse(self, rel, new_rel):
        raise StorageError(f"cannot move {self.url_of(rel)}: access denied")

    monkeypatch.setattr(Location, "move", refuse)
    store = RunStore(store_root, "proj", "run")
    with caplog.at_level(logging.WARNING, logger="trajflow.storage"):
        assert store.committed_steps() == [0]
        with pytest.raises(CorruptManifestError, match="it stays in place, it could not be moved aside") as info:
            store.read_manifest(1)
    assert not info.value.removed and "access denied" in caplog.text
    assert raw_storage.read(MANIFEST_1) == b"{"
    store.commit(1, {"reward": 1.0})
    assert RunStore(store_root, "proj", "run").read_manifest(1).metrics == {"reward": 1.0}


def test_publish_and_checkpoint_downloads_get_past_a_corrupt_manifest(store_root, raw_storage, tmp_path, monkeypatch):
    """The path that failed on every rerun: the publisher's hash-checked download of the step's adapter."""
    from backends.policy.publish import local_adapter

    monkeypatch.setenv("TRAJFLOW_CACHE", str(tmp_path / "fresh-machine-cache"))
    _commit_steps(RunStore(store_root, "proj", "run"))
    raw_storage.write(MANIFEST_1, raw_storage.read(MANIFEST_1)[:100])
    store = RunStore(store_root, "proj", "run")
    folder = local_adapter(store, 1, None, "proj", "run")
    assert (folder / "adapter_model.safetensors").read_bytes() == b"weights 1"
    assert store.committed_steps() == [0] and len(_aside(raw_storage)) == 1
    assert os.path.isdir(folder)
