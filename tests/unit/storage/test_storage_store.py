"""The run store on a local folder and on S3 (moto): layout, run.json, files, commit, manifests, folders."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from storage import HashMismatchError, NotFoundError, RunStore, StorageError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_layout_and_run_config(store_root, raw_storage):
    store = RunStore(store_root, "proj", "run-1")
    assert store.url == f"{store_root}/proj/run-1"
    assert store.step_url(7) == f"{store_root}/proj/run-1/steps/00007"
    assert store.read_run_config() is None

    config = {"model": "tiny", "lr": 1e-4, "nested": {"seeds": [1, 2]}, "text": "héllo"}
    store.write_run_config(config)
    store.put_bytes(3, "trajectories/group-0.parquet", b"pq")
    store.put_bytes(3, "adapter/adapter_model.safetensors", b"weights")
    store.put_json(None, "judge-cache/abc.json", {"score": 1})
    store.commit(3, metrics={"reward": 0.5})

    assert RunStore(store_root, "proj", "run-1").read_run_config() == config
    assert json.loads(raw_storage.read("proj/run-1/run.json")) == config
    assert raw_storage.keys() == [
        "proj/run-1/judge-cache/abc.json",
        "proj/run-1/run.json",
        "proj/run-1/steps/00003/adapter/adapter_model.safetensors",
        "proj/run-1/steps/00003/manifest.json",
        "proj/run-1/steps/00003/trajectories/group-0.parquet",
    ]


def test_file_url_and_plain_path_are_the_same_store(tmp_path):
    plain = RunStore(str(tmp_path), "p", "r")
    as_url = RunStore(f"file://{tmp_path}/", "p", "r")
    assert as_url.url == f"file://{tmp_path}/p/r"
    as_url.put_bytes(0, "a.txt", b"A")
    as_url.commit(0, {"m": 1.0})
    assert plain.committed_steps() == [0]
    assert plain.get_bytes(0, "a.txt") == b"A"
    assert (tmp_path / "p" / "r" / "steps" / "00000" / "manifest.json").is_file()


def test_relative_local_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RunStore("runs", "p", "r")
    assert store.root == str(tmp_path / "runs")
    store.put_bytes(None, "x.txt", b"x")
    assert (tmp_path / "runs" / "p" / "r" / "x.txt").read_bytes() == b"x"


def test_a_step_exists_only_once_committed(store_root, raw_storage):
    store = RunStore(store_root, "proj", "run")
    data = {"a.bin": b"\x00\x01" * 1000, "sub/b.json": b'{"x": 1}'}
    for rel, blob in data.items():
        assert store.put_bytes(0, rel, blob) == sha(blob)
    assert store.committed_steps() == []
    assert store.latest_step() is None
    with pytest.raises(NotFoundError, match=r"step 0 is not committed: .*/proj/run/steps/00000/manifest.json"):
        store.read_manifest(0)

    manifest = store.commit(0, metrics={"reward": 0.25, "n": 3}, extra={"policy": "m@0", "groups": 2})
    assert store.committed_steps() == [0]
    assert store.latest_step() == 0
    assert {k: (v.sha256, v.size) for k, v in manifest.files.items()} == {
        k: (sha(v), len(v)) for k, v in data.items()
    }
    assert manifest.metrics == {"reward": 0.25, "n": 3.0}
    assert manifest.extra == {"policy": "m@0", "groups": 2}
    assert manifest.created_at.endswith("Z") and manifest.trajflow_version

    # a fresh store (another process) reads the same manifest from storage
    again = RunStore(store_root, "proj", "run").read_manifest(0)
    assert again == manifest
    assert json.loads(raw_storage.read("proj/run/steps/00000/manifest.json"))["files"]["a.bin"]["sha256"] == sha(
        data["a.bin"]
    )


def test_commit_hashes_files_written_by_another_process(store_root, raw_storage):
    raw_storage.write("proj/run/steps/00002/other.bin", b"from elsewhere")
    manifest = RunStore(store_root, "proj", "run").commit(2)
    assert manifest.files["other.bin"].sha256 == sha(b"from elsewhere")


def test_files_json_listing_and_delete(store_root):
    store = RunStore(store_root, "proj", "run")
    store.put_json(1, "scores.json", {"r": [1, 0.5]})
    store.put_bytes(1, "trajectories/g0.parquet", b"0")
    store.put_bytes(1, "trajectories/g1.parquet", b"1")
    store.put_bytes(1, "trainer/optimizer.pt", b"opt")
    store.put_json(None, "judge-cache/h1.json", {"v": 1})
    store.write_run_config({"x": 1})

    assert store.get_json(1, "scores.json") == {"r": [1, 0.5]}
    assert store.exists(1, "trajectories/g0.parquet")
    assert not store.exists(1, "trajectories/g9.parquet")
    assert store.list_files(1) == ["scores.json", "trainer/optimizer.pt", "trajectories/g0.parquet", "trajectories/g1.parquet"]
    assert store.list_files(1, "trajectories/") == ["trajectories/g0.parquet", "trajectories/g1.parquet"]
    assert store.list_files(1, "trajectories/g1") == ["trajectories/g1.parquet"]
    assert store.list_files(1, "tr") == ["trainer/optimizer.pt", "trajectories/g0.parquet", "trajectories/g1.parquet"]
    assert store.list_files(2) == []
    # the run-level area lists the user's files only, never run.json or steps/
    assert store.list_files(None) == ["judge-cache/h1.json"]

    store.delete(1, "trajectories/g0.parquet")
    store.delete(1, "trajectories/g0.parquet")  # absent: no error
    assert store.list_files(1, "trajectories/") == ["trajectories/g1.parquet"]
    with pytest.raises(NotFoundError, match=r"cannot read .*/proj/run/steps/00001/trajectories/g0.parquet: it does not exist"):
        store.get_bytes(1, "trajectories/g0.parquet")


def test_committed_files_cannot_change(store_root):
    store = RunStore(store_root, "proj", "run")
    store.put_bytes(0, "a.txt", b"A")
    store.commit(0)
    assert store.put_bytes(0, "a.txt", b"A") == sha(b"A")  # same bytes: accepted, nothing rewritten
    with pytest.raises(StorageError, match=r"cannot overwrite .*/proj/run/steps/00000/a.txt: step 0 is committed"):
        store.put_bytes(0, "a.txt", b"B")
    with pytest.raises(StorageError, match=r"cannot delete .*/steps/00000/a.txt: step 0 is committed"):
        store.delete(0, "a.txt")
    assert store.get_bytes(0, "a.txt", verify=True) == b"A"
    store.put_bytes(0, "eval.json", b"{}")  # a new file may be added after commit; it is not in the manifest
    assert "eval.json" not in store.read_manifest(0).files


def test_commit_again_is_idempotent_only_for_identical_content(store_root):
    store = RunStore(store_root, "proj", "run")
    store.put_bytes(4, "a.txt", b"A")
    first = store.commit(4, {"loss": 1.0}, {"policy": "m@4"})
    assert RunStore(store_root, "proj", "run").commit(4, {"loss": 1.0}, {"policy": "m@4"}) == first
    with pytest.raises(StorageError, match=r"cannot commit step 4: .*/steps/00004/manifest.json already commits it .*metrics differ"):
        store.commit(4, {"loss": 2.0}, {"policy": "m@4"})
    store.put_bytes(4, "late.txt", b"L")
    with pytest.raises(StorageError, match=r"files differ: late.txt"):
        store.commit(4, {"loss": 1.0}, {"policy": "m@4"})
    assert store.read_manifest(4) == first


def _make_folder(root) -> dict[str, bytes]:
    files = {
        "adapter_config.json": b'{"r": 8}',
        "adapter_model.safetensors": os.urandom(300_000),
        "nested/deeper/notes.txt": b"x" * 10,
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def test_folder_upload_and_verified_download(store_root, tmp_path):
    files = _make_folder(tmp_path / "src")
    store = RunStore(store_root, "proj", "run")
    hashes = store.upload_folder(2, "adapter", tmp_path / "src")
    assert hashes == {rel: sha(data) for rel, data in files.items()}
    manifest = store.commit(2)
    assert {k: v.sha256 for k, v in manifest.files.items()} == {f"adapter/{k}": v for k, v in hashes.items()}

    out = RunStore(store_root, "proj", "run").download_folder(2, "adapter", tmp_path / "dst")
    assert out == tmp_path / "dst"
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == files
    # an uncommitted step downloads what is stored, unverified
    store.upload_folder(3, "adapter", tmp_path / "src")
    assert (store.download_folder(3, "adapter", tmp_path / "dst3") / "nested/deeper/notes.txt").read_bytes() == b"x" * 10
    with pytest.raises(NotFoundError, match=r"cannot download .*/steps/00002/nothing: the manifest of step 2 records no files"):
        store.download_folder(2, "nothing", tmp_path / "none")
    with pytest.raises(StorageError, match="is not a folder"):
        store.upload_folder(4, "adapter", tmp_path / "missing")


def test_tampered_file_fails_verification_and_names_the_file(store_root, raw_storage, tmp_path):
    files = _make_folder(tmp_path / "src")
    store = RunStore(store_root, "proj", "run")
    store.upload_folder(5, "adapter", tmp_path / "src")
    store.commit(5)
    tampered = bytearray(files["adapter_model.safetensors"])
    tampered[1000] ^= 0xFF
    raw_storage.write("proj/run/steps/00005/adapter/adapter_model.safetensors", bytes(tampered))

    fresh = RunStore(store_root, "proj", "run")
    with pytest.raises(HashMismatchError) as info:
        fresh.download_folder(5, "adapter", tmp_path / "dst")
    msg = str(info.value)
    assert f"{store_root}/proj/run/steps/00005/adapter/adapter_model.safetensors" in msg
    assert sha(files["adapter_model.safetensors"]) in msg and sha(bytes(tampered)) in msg
    assert not (tmp_path / "dst" / "adapter_model.safetensors").exists()  # the bad file is never put in place
    assert [p.name for p in (tmp_path / "dst").iterdir() if p.name.startswith(".")] == []  # no temp left
    with pytest.raises(HashMismatchError, match="adapter_model.safetensors"):
        fresh.get_bytes(5, "adapter/adapter_model.safetensors", verify=True)
    # without verification the (tampered) bytes come back as stored
    assert fresh.get_bytes(5, "adapter/adapter_model.safetensors") == bytes(tampered)
    # a recorded file that disappeared is named too
    raw_storage.delete("proj/run/steps/00005/adapter/adapter_config.json")
    with pytest.raises(NotFoundError, match=r"steps/00005/adapter/adapter_config.json: it does not exist"):
        fresh.download_folder(5, "adapter", tmp_path / "dst2")


def test_two_writers_committing_the_same_step(store_root, monkeypatch):
    """The manifest is created exclusively: when another writer committed first, the loser compares."""
    winner, loser = RunStore(store_root, "proj", "run"), RunStore(store_root, "proj", "run")
    winner.put_bytes(0, "a.txt", b"A")
    first = winner.commit(0, {"reward": 1.0})
    real_read = loser.read_manifest
    calls: list[int] = []

    def stale_first_read(step):  # the loser looked before the winner's manifest landed
        calls.append(step)
        if len(calls) == 1:
            raise NotFoundError("not yet")
        return real_read(step)

    with monkeypatch.context() as patch:
        patch.setattr(loser, "read_manifest", stale_first_read)
        assert loser.commit(0, {"reward": 1.0}) == first  # identical content: the winner's manifest is returned
        assert len(calls) == 2
        calls.clear()
        with pytest.raises(StorageError, match="already commits it with different content .*metrics differ"):
            loser.commit(0, {"reward": 2.0})
    assert winner.read_manifest(0) == first


def test_listings_see_changes_made_by_other_writers(store_root, raw_storage):
    """s3fs caches listings; the store invalidates them, so out-of-band writes and deletes show at once."""
    store = RunStore(store_root, "proj", "run")
    store.put_bytes(0, "a.txt", b"A")
    store.commit(0)
    assert store.list_files(0) == ["a.txt"] and store.committed_steps() == [0]
    raw_storage.write("proj/run/steps/00000/b.txt", b"B")
    raw_storage.write("proj/run/steps/00001/x.txt", b"X")
    raw_storage.write("proj/run/steps/00001/manifest.json", raw_storage.read("proj/run/steps/00000/manifest.json").replace(b'"step": 0', b'"step": 1'))
    assert store.list_files(0) == ["a.txt", "b.txt"]
    assert store.exists(0, "b.txt")
    assert store.committed_steps() == [0, 1]
    raw_storage.delete("proj/run/steps/00000/manifest.json")
    assert store.committed_steps() == [1]
    assert not store.exists(0, "zzz.txt")


async def test_usable_from_async_code(store_root):
    """Called from a running event loop (as async tasks do), the blocking API still works on both backends."""
    store = RunStore(store_root, "proj", "run")
    store.put_json(0, "x.json", {"a": 1})
    store.commit(0)
    assert store.get_json(0, "x.json") == {"a": 1} and store.committed_steps() == [0]


def test_amend_metrics_of_a_committed_step(store_root):
    store = RunStore(store_root, "proj", "run")
    store.put_bytes(2, "a.txt", b"A")
    first = store.commit(2, {"train/loss": 0.5}, {"policy": "m@2"})
    amended = store.amend_metrics(2, {"val/reward": 0.75, "train/loss": 0.25})
    again = RunStore(store_root, "proj", "run").read_manifest(2)
    assert again == amended
    assert again.metrics == {"train/loss": 0.25, "val/reward": 0.75}
    assert again.files == first.files and again.extra == first.extra and again.created_at == first.created_at
    with pytest.raises(NotFoundError, match="step 3 is not committed"):
        store.amend_metrics(3, {"val/reward": 1.0})
    with pytest.raises(ValueError, match="must be a number"):
        store.amend_metrics(2, {"val/reward": "high"})
