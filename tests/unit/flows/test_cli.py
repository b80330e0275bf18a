"""The `trajflow` command and the flows' own entry points: the same arguments, a light parser, no flow until one runs."""

from __future__ import annotations

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


def test_python_dash_m_entry_points_take_the_same_arguments():
    for module, extra in (("flows.train", None), ("flows.evaluate", "--policy NAME")):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: python -m {module} [-h] [--set KEY=VALUE]")
        assert (extra in out.stdout) if extra else ("--policy" not in out.stdout)
