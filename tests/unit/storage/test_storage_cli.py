"""`trajflow runs [ROOT] [--json]` through argparse with storage.cli.register, and list_runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from storage import RunStore
from storage.cli import compress_steps, register
from storage.runs import list_runs
from tests.paths import REPO


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trajflow")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _populate(root: str, raw_storage) -> None:
    a = RunStore(root, "demo", "run-1")
    for step, (reward, loss) in enumerate([(0.25, 1.5), (0.5, 1.25), (0.75, 1.0)]):
        a.put_bytes(step, "trajectories.parquet", b"t")
        a.commit(step, {"reward": reward, "loss": loss})
    a.put_bytes(3, "trajectories.parquet", b"t")  # step 3 written, never committed
    a.put_bytes(5, "trajectories.parquet", b"t")
    a.commit(5, {"reward": 0.875})
    b = RunStore(root, "demo", "empty-run")
    b.write_run_config({"model": "tiny"})
    c = RunStore(root, "other", "r.2")
    c.commit(0)
    raw_storage.write("not..valid/run/run.json", b"{}")  # not a valid project name: skipped


def test_runs_table_and_json(store_root, raw_storage, capsys):
    _populate(store_root, raw_storage)

    assert _cli(["runs", store_root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"project": "demo", "run": "empty-run", "steps": [], "metrics": {}},
        {"project": "demo", "run": "run-1", "steps": [0, 1, 2, 5], "metrics": {"reward": 0.875}},
        {"project": "other", "run": "r.2", "steps": [0], "metrics": {}},
    ]

    assert _cli(["runs", store_root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["PROJECT", "RUN", "UPDATES", "COMMITTED", "LAST", "METRICS", "(last", "step)"]
    assert lines[1].split() == ["demo", "empty-run", "0", "-", "-", "-"]
    assert lines[2].split() == ["demo", "run-1", "3", "0-2,5", "5", "reward=0.875"]  # step 0 is no update
    assert lines[3].split() == ["other", "r.2", "0", "0", "0", "-"]
    assert lines[4] == "step 0 is the untrained policy; UPDATES counts the committed GRPO updates after it"

    runs = list_runs(store_root)
    assert [(r.project, r.run, r.latest_step) for r in runs] == [
        ("demo", "empty-run", None),
        ("demo", "run-1", 5),
        ("other", "r.2", 0),
    ]
    assert runs[1].url == f"{store_root}/demo/run-1"


def test_default_root_comes_from_the_environment(tmp_path, monkeypatch, capsys):
    RunStore(str(tmp_path / "env-root"), "p", "r").commit(0, {"loss": 0.5})
    monkeypatch.setenv("TRAJFLOW_STORAGE", str(tmp_path / "env-root"))
    assert _cli(["runs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"project": "p", "run": "r", "steps": [0], "metrics": {"loss": 0.5}}]

    monkeypatch.delenv("TRAJFLOW_STORAGE")
    monkeypatch.chdir(tmp_path)
    assert _cli(["runs"]) == 1  # ./runs does not exist here
    assert f"cannot list runs under {tmp_path / 'runs'}: it does not exist" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    assert _cli(["runs"]) == 0
    assert capsys.readouterr().out.strip() == "no runs under ./runs"


def test_many_metrics_are_abbreviated(tmp_path, capsys):
    RunStore(str(tmp_path), "p", "r").commit(0, {f"m{i}": i / 3 for i in range(8)})
    assert _cli(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "m0=0 m1=0.3333 m2=0.6667" in out and "(+2 more)" in out


def test_compress_steps():
    assert compress_steps([]) == ""
    assert compress_steps([3]) == "3"
    assert compress_steps([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_cli_module_imports_nothing_heavy():
    code = (
        "import sys, storage.cli; "
        "heavy = [m for m in ('torch', 'transformers', 'pyarrow', 'agents', 'openai', 's3fs', 'prefect') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_through_the_trajflow_entry_point(tmp_path):
    RunStore(str(tmp_path), "p", "r").commit(0, {"reward": 0.5})
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "runs", str(tmp_path), "--json"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"project": "p", "run": "r", "steps": [0], "metrics": {"reward": 0.5}}]
