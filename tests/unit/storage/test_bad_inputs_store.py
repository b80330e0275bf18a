"""The run store's catalogue of bad inputs: every one we know, and the clear error each one gets.

Each table row is (id, call, expected exception, message pattern). A bad input is refused before
anything is written, and the message names what is wrong; nothing here may end in an AttributeError,
a bare OSError or a traceback. `trajflow runs` turns each storage error into one line on stderr and
exit status 1. Rows that need a store run on a local folder and on S3 (moto).

Covered by their own tests (they need more than one call):
- the name rules, case by case: tests/unit/storage/test_storage_names.py (INVALID_NAMES, test_unsafe_relpaths);
- a missing bucket on every operation, wrong credentials, an unreachable endpoint, a commit killed or
  failing while it writes the manifest: tests/unit/storage/test_storage_failures.py;
- a file changed after its step was committed: test_tampered_file_fails_verification_and_names_the_file
  and test_committed_files_cannot_change in tests/unit/storage/test_storage_store.py;
- a corrupt manifest.json (truncated, empty, not UTF-8, wrong shape, another step's, a path escaping the
  step), found by any reader, moved aside and the step redone: tests/unit/storage/test_storage_corrupt_manifest.py
  and, through a resumed flow, tests/integration/test_resume_corrupt_manifest.py.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agents import Trajectory, TrajectoryGroup
from storage import InvalidNameError, RunStore, StorageError
from storage.cli import register
from storage.runs import list_runs
from tests.paths import REPO

UNSUPPORTED = r"scheme {!r} is not supported; use a local folder, file://PATH or s3://BUCKET/PREFIX"


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ---- storage roots: (id, root, expected message); each is refused by RunStore and by list_runs ----------------
ROOTS = [
    ("ftp", "ftp://example.com/runs", UNSUPPORTED.format("ftp")),
    ("unknown scheme", "foo://bar/runs", UNSUPPORTED.format("foo")),
    ("http fetches URLs", "http://127.0.0.1:9/runs", UNSUPPORTED.format("http")),
    ("gcs not supported", "gs://bucket/runs", UNSUPPORTED.format("gs")),
    ("memory is not storage", "memory://runs", UNSUPPORTED.format("memory")),
    ("empty", "", "invalid storage root '': expected a folder path"),
    ("blank", "   ", "invalid storage root '   ': expected a folder path"),
    ("None", None, "invalid storage root None: expected a folder path"),
    ("a number", 5, "invalid storage root 5: expected a folder path"),
    ("NUL", "/tmp/runs\x00x", r"invalid storage root '/tmp/runs\\x00x': control characters"),
    ("newline", "/tmp/runs\nx", r"invalid storage root '/tmp/runs\\nx': control characters"),
    ("s3 without bucket", "s3://", "invalid storage root 's3://': a URL needs a bucket or folder after '://'"),
    ("s3 bad bucket name", "s3://Not_A_Bucket!/x", "bucket name 'Not_A_Bucket!' may hold only letters, digits"),
]


@pytest.mark.parametrize("root, message", [r[1:] for r in ROOTS], ids=[r[0] for r in ROOTS])
def test_bad_roots(root, message):
    with pytest.raises(StorageError, match=message):
        RunStore(root, "proj", "run")
    with pytest.raises(StorageError, match=message):
        list_runs(root)


def test_root_that_is_a_file_or_under_a_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=rf"cannot use storage root {blocker}: it is a file, not a folder"):
        list_runs(str(blocker))
    for root in (blocker / "sub", f"file://{blocker}/sub"):
        with pytest.raises(StorageError, match=rf"{blocker} is a file, not a folder"):
            list_runs(str(root))
    store = RunStore(str(blocker), "proj", "run")
    calls = {
        "write": lambda: store.put_bytes(0, "a.txt", b"x"),
        "write run.json": lambda: store.write_run_config({}),
        "read": lambda: store.get_bytes(0, "a.txt"),
        "read run.json": store.read_run_config,
        "list steps": store.committed_steps,
        "list files": lambda: store.list_files(0),
        "check": lambda: store.exists(0, "a.txt"),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError, match=rf"{blocker} is a file, not a folder") as info:
            call()
        assert "does not exist" not in str(info.value), name
    assert blocker.read_text() == "not a folder"


def test_missing_local_root_is_named(tmp_path):
    with pytest.raises(StorageError, match=rf"cannot list runs under {tmp_path / 'nothing'}: it does not exist"):
        list_runs(str(tmp_path / "nothing"))


# ---- names and paths inside a run: (id, call on a store, exception, message) ------------------------------------
def _store_cases():
    def group():
        return [TrajectoryGroup([Trajectory()])]

    return [
        ("project with ..", lambda s: RunStore(s.root, "..", "run"), InvalidNameError, "invalid project name '..'"),
        ("run with /", lambda s: RunStore(s.root, "proj", "a/b"), InvalidNameError, "invalid run name 'a/b'"),
        ("run absolute", lambda s: RunStore(s.root, "proj", "/etc"), InvalidNameError, "invalid run name '/etc'"),
        ("run with NUL", lambda s: RunStore(s.root, "proj", "r\x00"), InvalidNameError, r"invalid run name 'r\\x00'"),
        ("path escapes the step", lambda s: s.put_bytes(0, "../run.json", b"x"), InvalidNameError,
         r"invalid relative path '\.\./run\.json'"),
        ("path escapes the run", lambda s: s.put_bytes(None, "../../other/run.json", b"x"), InvalidNameError,
         r"'\.\.' is not allowed"),
        ("absolute path", lambda s: s.put_bytes(0, "/etc/passwd", b"x"),
         InvalidNameError, "absolute paths are not allowed"),
        ("NUL in a path", lambda s: s.put_bytes(0, "a\x00b", b"x"), InvalidNameError, "control characters"),
        ("backslash in a path", lambda s: s.get_bytes(0, "..\\x"), InvalidNameError, "backslashes are not allowed"),
        ("temp-file name", lambda s: s.put_bytes(0, ".a.tmp-" + "0" * 32, b"x"), InvalidNameError,
         "reserved for temporary files"),
        ("forged manifest", lambda s: s.put_bytes(0, "manifest.json", b"{}"), InvalidNameError,
         "'manifest.json' .* is written only by the store"),
        ("forged quarantined manifest", lambda s: s.put_bytes(0, "manifest.json.corrupt-20260101T0000Z", b"{}"),
         InvalidNameError, "is written only by the store"),
        ("run.json as a file", lambda s: s.put_bytes(None, "run.json", b"{}"), InvalidNameError,
         "'run.json', 'lease.json' and 'steps/' are managed by the store"),
        ("a step's file at run level", lambda s: s.put_bytes(None, "steps/00001/manifest.json", b"{}"),
         InvalidNameError,
         "managed by the store"),
        ("download escapes", lambda s: s.download_folder(0, "../..", "/tmp/never"), InvalidNameError, r"'\.\.'"),
        ("listing prefix escapes", lambda s: s.list_files(0, "../"), InvalidNameError, r"'\.\.'"),
        ("pruning prefix escapes", lambda s: s.apply_retention(1, prune=("../",)), InvalidNameError, r"'\.\.'"),
        ("path not a string", lambda s: s.put_bytes(0, None, b"x"), InvalidNameError, "must be a non-empty string"),
        ("step negative", lambda s: s.put_bytes(-1, "a.txt", b"x"),
         ValueError, r"step must be an integer in \[0, 99999\]"),
        ("step too large", lambda s: s.commit(100_000), ValueError, "step must be an integer"),
        ("step a float", lambda s: s.commit(1.5), ValueError, "step must be an integer"),
        ("step a bool", lambda s: s.commit(True), ValueError, "step must be an integer"),
        ("step a string", lambda s: s.get_bytes("3", "a.txt"), ValueError, "step must be an integer"),
        ("text instead of bytes", lambda s: s.put_bytes(0, "a.txt", "text"),
         TypeError, "put_bytes needs bytes .* got str"),
        ("run config not a dict", lambda s: s.write_run_config(["x"]), TypeError, "run config must be a dict"),
        ("value not JSON", lambda s: s.put_json(0, "x.json", {"f": object()}), TypeError, "not JSON-serialisable"),
        ("metric not a number", lambda s: s.commit(0, {"loss": "low"}), ValueError, "metric 'loss' must be a number"),
        ("metric without a name", lambda s: s.commit(0, {"": 1.0}),
         ValueError, "metric names must be non-empty strings"),
        ("extra not JSON", lambda s: s.commit(0, {}, {"x": object()}), ValueError, "must be JSON-serialisable"),
        ("extra with a tuple", lambda s: s.commit(0, {}, {"x": (1, 2)}), ValueError, "plain JSON"),
        ("amend a step never committed", lambda s: s.amend_metrics(3, {"r": 1.0}),
         StorageError, "step 3 is not committed"),
        ("upload a missing folder", lambda s: s.upload_folder(0, "adapter", "/nonexistent-folder"), StorageError,
         "cannot upload /nonexistent-folder: it is not a folder"),
        ("download nothing", lambda s: s.download_folder(0, "adapter", "/tmp/never"), StorageError,
         "cannot download .*/steps/00000/adapter: no files under it"),
        ("token id beyond int32", lambda s: s.write_groups(0, "t.parquet", [TrajectoryGroup([Trajectory(
            messages_and_choices=[{"message": {"role": "assistant", "content": "x"}, "prompt_token_ids": [1],
                                   "token_ids": [2**31], "logprobs": [-0.1]}])])]), ValueError,
         "token ids must fit int32"),
        ("not a group", lambda s: s.write_groups(0, "t.parquet", [Trajectory()]),
         TypeError, r"groups\[0\] is a Trajectory"),
        ("a group not awaited", lambda s: s.write_groups(0, "t.parquet", [TrajectoryGroup([_never()])]), ValueError,
         "rollouts not awaited yet"),
        ("groups as a value", lambda s: s.write_groups(0, "t.parquet", group()[0]), TypeError, "is a"),
    ]


async def _never():  # a rollout that is never awaited
    return Trajectory()


STORE_CASES = _store_cases()


@pytest.mark.filterwarnings("ignore:coroutine '_never' was never awaited")
@pytest.mark.parametrize("call, error, message", [c[1:] for c in STORE_CASES], ids=[c[0] for c in STORE_CASES])
def test_bad_store_inputs(store_root, raw_storage, call, error, message):
    store = RunStore(store_root, "proj", "run")
    with pytest.raises(error, match=message):
        call(store)
    written = [k for k in raw_storage.keys() if "/steps/" in k or k.endswith("run.json")]  # noqa: SIM118
    assert written == []  # refused before anything was written


# ---- damaged files in storage: (id, {path under the run: bytes}, call, exception, message) -----------------------
CORRUPT = [
    ("run.json not JSON", {"run.json": b'{"lr": 0.1'}, lambda s: s.read_run_config(), StorageError,
     r"cannot read .*/proj/run/run.json: not valid JSON"),
    ("run.json not UTF-8", {"run.json": b"\xff\xfe{}"}, lambda s: s.read_run_config(), StorageError,
     r"cannot read .*/proj/run/run.json: not valid JSON"),
    ("a JSON file not JSON", {"steps/00000/x.json": b"{"}, lambda s: s.get_json(0, "x.json"), StorageError,
     r"cannot read .*/steps/00000/x.json: not valid JSON"),
    ("Parquet that is not Parquet", {"steps/00000/t.parquet": b"PAR1 not really"},
     lambda s: s.read_groups(0, "t.parquet"), StorageError, r"cannot read trajectories from .*/steps/00000/t.parquet"),
    ("Parquet of another kind", {"steps/00000/t.parquet": _parquet(pa.table({"x": [1]}))},
     lambda s: s.read_groups(0, "t.parquet"), StorageError, "not a trajflow trajectories file"),
    ("a missing file", {}, lambda s: s.get_bytes(0, "absent.bin"), StorageError,
     r"cannot read .*/steps/00000/absent.bin: it does not exist"),
]


@pytest.mark.parametrize("files, call, error, message", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_damaged_files(store_root, raw_storage, files, call, error, message):
    for rel, data in files.items():
        raw_storage.write(f"proj/run/{rel}", data)
    with pytest.raises(error, match=message):
        call(RunStore(store_root, "proj", "run"))
    for rel, data in files.items():
        assert raw_storage.read(f"proj/run/{rel}") == data  # left as found (only corrupt manifests are moved aside)


# ---- the command line: `trajflow runs ROOT` prints one line and exits 1 ----------------------------------------
def _runs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trajflow")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("root, message", [
    ("ftp://example.com/runs", UNSUPPORTED.format("ftp")),
    ("foo://bar", UNSUPPORTED.format("foo")),
    ("/tmp/runs\x00", "control characters"),
], ids=["ftp", "unknown scheme", "NUL"])
def test_runs_command_bad_roots(root, message, capsys):
    assert _runs(["runs", root]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trajflow runs: error: invalid storage root"), captured.err
    assert captured.out == ""
    assert re.search(message, lines[0])


def test_runs_command_root_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert _runs(["runs", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"trajflow runs: error: cannot use storage root {tmp_path / 'f'}: it is a file, not a folder")


def test_runs_command_unknown_scheme_through_the_entry_point():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "runs", "ftp://example.com/runs"], check=False,
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "AttributeError" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        ("trajflow runs: error: invalid storage root 'ftp://example.com/runs': scheme 'ftp' is not supported; "
         "use a local folder, file://PATH or s3://BUCKET/PREFIX")]
