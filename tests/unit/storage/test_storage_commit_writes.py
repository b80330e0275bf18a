"""What a commit writes, recorded where the bytes reach storage: manifest.json exactly once, and last.

A commit that wrote the manifest early (say an empty one, rewritten after hashing) would leave a
window in which a crash publishes a step whose files are not all recorded; every other storage
test passes with such a commit, so the writes themselves are checked here, on a local folder and on
S3 (tests/fixtures_s3.py: StorageWrites).
"""

from __future__ import annotations

from storage import RunStore
from storage.layout import MANIFEST


def _step_files(store: RunStore, step: int, adapter_src) -> None:
    store.put_bytes(step, "scored.parquet", f"groups of step {step}".encode())
    store.put_json(step, "training.json", {"loss": 0.5})
    store.upload_folder(step, "adapter", adapter_src)


def test_commit_writes_the_manifest_once_and_last(store_root, storage_writes, adapter_src):
    store = RunStore(store_root, "proj", "run")
    manifest_path = f"proj/run/steps/00001/{MANIFEST}"
    _step_files(store, 1, adapter_src)
    writes_before = list(storage_writes.events)
    assert writes_before and manifest_path not in storage_writes.paths()  # the recorder sees the data files

    storage_writes.events.clear()
    manifest = store.commit(1, {"train/reward": 0.5}, {"policy": "run@1"})
    assert storage_writes.paths().count(manifest_path) == 1, storage_writes.events
    assert storage_writes.paths()[-1] == manifest_path, storage_writes.events
    assert RunStore(store_root, "proj", "run").read_manifest(1) == manifest  # the one write is the final manifest

    # committing the same content again writes nothing
    storage_writes.events.clear()
    assert store.commit(1, {"train/reward": 0.5}, {"policy": "run@1"}) == manifest
    assert storage_writes.events == []


def test_commit_of_files_written_by_another_process(store_root, storage_writes, raw_storage, adapter_src):
    """Files this store instance did not write are read back and hashed; still one manifest write, last."""
    _step_files(RunStore(store_root, "proj", "run"), 2, adapter_src)
    raw_storage.write("proj/run/steps/00002/other.bin", b"from elsewhere")
    storage_writes.events.clear()
    store = RunStore(store_root, "proj", "run")
    manifest = store.commit(2)
    assert "other.bin" in manifest.files
    assert storage_writes.paths() == [f"proj/run/steps/00002/{MANIFEST}"]
