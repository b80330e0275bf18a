"""The `trajflow` command and the flows' own entry points: the same arguments, a light parser, no flow until one runs."""

from __future__ import annotations

import json
import subprocess
import sys

from flows.cli import build_parser
from tests.paths import REPO


def test_train_and_eval_arguments():
    parser = build_parser()
    train = parser.parse_args(["train", "configs/tiny.yaml", "--set", "steps=3", "--set", "run=b"])
    assert (train.config, train.overrides, train.func.__name__) == ("configs/tiny.yaml", ["steps=3", "run=b"],
                                                                     "_run_train")
    evaluate = parser.parse_args(["eval", "--policy", "base", "--policy", "@2"])
    assert (evaluate.config, evaluate.overrides, evaluate.policies, evaluate.func.__name__) == (
        None, [], ["base", "@2"], "_run_eval")


def test_building_the_parser_imports_no_flow():
    code = ("import sys, flows.cli; flows.cli.build_parser(); "
            "print([m for m in ('prefect', 'torch', 'tasks', 'agents', 'flows.train', 'flows.evaluate') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_commands_that_train_nothing_import_no_torch():
    # `trajflow deploy` (twice in the preemption test) and `config show` start ~2.5 s sooner without it
    code = "import sys, flows.deploy, flows.config_show; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_python_dash_m_entry_points_take_the_same_arguments():
    for module, extra in (("flows.train", None), ("flows.evaluate", "--policy NAME")):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: python -m {module} [-h] [--set KEY=VALUE]")
        assert (extra in out.stdout) if extra else ("--policy" not in out.stdout)


def test_demos_writes_checked_train_demonstrations(tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "ttt.jsonl"
    assert main(["demos", "tictactoe", "--count", "3", "--seed", "1", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["metadata"]["split"] for x in lines] == ["train"] * 3 and {x["metadata"]["seed"] for x in lines} == {1}
    assert capsys.readouterr().out.startswith(f"wrote 3 tictactoe demonstrations (train split, seed 1) to {out}")
    assert main(["demos", "research", "--count", "5", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 5  # written again, whole
