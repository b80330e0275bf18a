"""Bad storage and crashes: missing bucket, wrong credentials, unreachable endpoint, a killed commit."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest

from storage import NotFoundError, RunStore, StorageError
from storage.cli import register
from storage.runs import list_runs
from tests.paths import REPO


def test_missing_bucket_is_named_on_every_operation(s3_endpoint, capsys):
    bucket = f"tf-missing-{uuid.uuid4().hex[:12]}"
    store = RunStore(f"s3://{bucket}/root", "proj", "run")
    expected = rf"s3://{bucket}/root/proj/run.*bucket '{bucket}' does not exist"
    with pytest.raises(StorageError, match=expected):
        store.committed_steps()
    with pytest.raises(StorageError, match=expected) as info:
        store.read_run_config()  # not None: a typo in the bucket must not look like a new run
    assert not isinstance(info.value, NotFoundError)
    with pytest.raises(StorageError, match=rf"cannot write s3://{bucket}/root/proj/run/steps/00000/a.txt: .*bucket '{bucket}' does not exist"):
        store.put_bytes(0, "a.txt", b"x")
    with pytest.raises(StorageError, match=expected):
        store.exists(0, "a.txt")
    with pytest.raises(StorageError, match=f"bucket '{bucket}' does not exist"):
        list_runs(f"s3://{bucket}/root")

    parser = argparse.ArgumentParser(prog="trajflow")
    register(parser.add_subparsers())
    args = parser.parse_args(["runs", f"s3://{bucket}/root"])
    assert args.func(args) == 1
    assert f"bucket '{bucket}' does not exist" in capsys.readouterr().err


def test_wrong_credentials_are_refused_clearly_without_leaking_secrets(s3_bucket, s3_iam_user):
    """moto checks signatures here (s3_iam_user switches it on): the right key works, a wrong one is refused."""
    from tests.fixtures_s3 import DUMMY_SECRET

    root = f"s3://{s3_bucket}/root"
    good = RunStore(root, "proj", "run", storage_options=dict(s3_iam_user))
    good.put_bytes(0, "a.txt", b"A")
    good.commit(0)
    assert good.committed_steps() == [0]

    wrong_secret = "WRONG-secret-0123456789abcdef"
    cases = {
        "wrong secret": {"key": s3_iam_user["key"], "secret": wrong_secret},
        "unknown key": {"key": "AKIAUNKNOWNKEY000000", "secret": wrong_secret},
        "environment's dummy key": None,
    }
    for case, options in cases.items():
        store = RunStore(root, "proj", "run", storage_options=options)
        calls = (
            store.committed_steps,
            lambda: store.get_bytes(0, "a.txt"),
            lambda: store.put_bytes(1, "b.txt", b"B"),
            lambda: store.exists(0, "a.txt"),
            store.read_run_config,
        )
        for call in calls:
            with pytest.raises(StorageError) as info:
                call()
            msg = str(info.value)
            assert f"{root}/proj/run" in msg, (case, msg)
            assert "access denied, check the credentials" in msg, (case, msg)
            for secret in (wrong_secret, s3_iam_user["secret"], DUMMY_SECRET):
                assert secret not in msg, (case, msg)
    assert good.committed_steps() == [0]
    assert good.list_files(1) == []


def test_unreachable_endpoint_is_a_clear_error(s3_endpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        "key": "some-key-id",
        "secret": "do-not-print-me",
    }
    store = RunStore("s3://some-bucket/root", "proj", "run", storage_options=options)
    with pytest.raises(StorageError, match=r"cannot (read|access) s3://some-bucket/root/proj/run.*cannot reach the storage endpoint") as info:
        store.read_run_config()
    assert "do-not-print-me" not in str(info.value)


def _seed_steps(store: RunStore, src) -> None:
    store.put_bytes(0, "trajectories.parquet", b"t0")
    store.upload_folder(0, "adapter", src)
    store.commit(0, {"reward": 1.0})
    store.put_bytes(1, "trajectories.parquet", b"t1")
    store.upload_folder(1, "adapter", src)


def _check_after_crash(root: str, src, tmp_path) -> RunStore:
    store = RunStore(root, "proj", "run")
    assert store.committed_steps() == [0]
    assert not store.is_committed(1)
    with pytest.raises(NotFoundError, match="step 1 is not committed"):
        store.read_manifest(1)
    out = store.download_folder(0, "adapter", tmp_path / f"check-{uuid.uuid4().hex[:6]}")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    assert store.get_bytes(0, "trajectories.parquet", verify=True) == b"t0"
    return store


def test_exception_while_writing_the_manifest(store_root, adapter_src, tmp_path, monkeypatch):
    store = RunStore(store_root, "proj", "run")
    _seed_steps(store, adapter_src)

    def refuse(name):
        if name.endswith("/steps/00001/manifest.json"):
            raise ConnectionResetError("connection reset while writing")

    with monkeypatch.context() as patch:
        if store_root.startswith("s3://"):
            import s3fs

            original = s3fs.S3FileSystem._call_s3

            async def call_s3(self, method, *args, **kwargs):
                if method == "put_object":
                    refuse(kwargs["Key"])
                return await original(self, method, *args, **kwargs)

            patch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
        else:
            # the manifest's temporary file is complete; the final rename (or exclusive link) fails
            for name in ("replace", "link"):
                original_op = getattr(os, name)

                def op(src, dst, _original=original_op, **kwargs):
                    refuse(os.fspath(dst))
                    return _original(src, dst, **kwargs)

                patch.setattr(os, name, op)

        with pytest.raises(StorageError, match=r"cannot write .*/proj/run/steps/00001/manifest.json: .*connection reset"):
            store.commit(1, {"reward": 2.0})
    store = _check_after_crash(store_root, adapter_src, tmp_path)
    assert store.commit(1, {"reward": 2.0}).metrics == {"reward": 2.0}
    assert store.committed_steps() == [0, 1]


CHILD = textwrap.dedent(
    """
    import os, shutil, signal, sys
    sys.path.insert(0, {repo!r})
    from storage import RunStore

    root, phase, src = sys.argv[1:4]
    store = RunStore(root, "proj", "run")
    store.put_bytes(0, "trajectories.parquet", b"t0")
    store.upload_folder(0, "adapter", src)
    store.commit(0, {{"reward": 1.0}})

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    target = "manifest.json" if phase == "manifest" else "adapter_model.safetensors"
    if root.startswith("s3://"):
        import s3fs
        original = s3fs.S3FileSystem._call_s3
        async def call_s3(self, method, *args, **kwargs):
            if method == "put_object" and kwargs["Key"].endswith("00001/" + target if phase == "manifest" else target) \\
                    and "/00001/" in kwargs["Key"]:
                die()
            return await original(self, method, *args, **kwargs)
        s3fs.S3FileSystem._call_s3 = call_s3
    elif phase == "manifest":
        def guarded(original):
            def op(a, b, **kwargs):
                if os.fspath(b).endswith("/steps/00001/manifest.json"):
                    die()  # the manifest's temporary file is complete on disk, it never gets its name
                return original(a, b, **kwargs)
            return op
        os.replace, os.link = guarded(os.replace), guarded(os.link)
    else:
        def copyfileobj(fsrc, fdst, length=0):
            fdst.write(fsrc.read(50_000))
            fdst.flush()
            os.fsync(fdst.fileno())
            die()  # half of the adapter is on disk in its temporary file
        shutil.copyfileobj = copyfileobj

    store.put_bytes(1, "trajectories.parquet", b"t1")
    store.upload_folder(1, "adapter", src)
    store.commit(1, {{"reward": 2.0}})
    print("NOT KILLED")
    """
)


@pytest.mark.parametrize("phase", ["data", "manifest"])
def test_killed_commit_leaves_the_previous_step_intact(store_root, adapter_src, tmp_path, phase, raw_storage):
    """A real crash: the writer process is SIGKILLed in the middle of step 1 (during a file, or the manifest)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    proc = subprocess.run(
        [sys.executable, str(script), store_root, phase, str(adapter_src)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)
    assert "NOT KILLED" not in proc.stdout

    store = _check_after_crash(store_root, adapter_src, tmp_path)
    stored = raw_storage.keys()
    if not store_root.startswith("s3://"):
        leftovers = [k for k in stored if ".tmp-" in k]
        assert len(leftovers) == 1 and "/steps/00001/" in leftovers[0]  # the crash left a temp file behind...
    assert all(".tmp-" not in f for f in store.list_files(1))  # ...which readers never see

    # resuming: write step 1 again and commit; the temporary leftovers are not part of it
    store.put_bytes(1, "trajectories.parquet", b"t1")
    store.upload_folder(1, "adapter", adapter_src)
    manifest = store.commit(1, {"reward": 2.0})
    assert sorted(manifest.files) == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors", "trajectories.parquet"]
    assert store.committed_steps() == [0, 1]
    store.download_folder(1, "adapter", tmp_path / "resumed")
