"""training.mode=process: the trainer in a child process of the flow (tasks/support/trainer_process.py), for real.

Each test starts real children (python -m tasks.support.trainer_worker) on configs/tiny.yaml's tiny-random model;
the flow-level kill and resume in this mode is in test_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from storage.errors import NotFoundError
from tasks.run_config import load_config
from tasks.support.retry_policy import TransientError, is_transient
from tasks.support.trainer_process import (TrainerLostError, TrainerProcess, error_record, protocol_line,
                                           rebuilt_error)
from tests.paths import REPO


def gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent died too, and nobody reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout_s} s later"
        time.sleep(0.1)


def test_errors_come_back_as_their_type_and_a_lost_child_is_replaced(tmp_path, caplog):
    config = load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", "training.mode=process"])
    trainer = TrainerProcess(config)
    try:
        result, _ = trainer.request("initialize", 0)
        assert result["step"] == 0 and (tmp_path / "runs/ci/tiny/steps/00000/training.json").exists()
        first = trainer.pid

        # the child's own error: its type and message, not a traceback of the protocol; the child lives on
        with pytest.raises(NotFoundError, match=r"training step 1 in the trainer process: .*00001/scored.parquet"):
            trainer.request("train", 1)
        assert trainer.pid == first

        # killed (out of memory, preemption): a transient error the task retries
        os.kill(first, signal.SIGKILL)
        with pytest.raises(TrainerLostError, match=r"training step 1: the trainer process \(pid \d+\) ended with "
                                                   r"signal SIGKILL") as lost:
            trainer.request("train", 1)
        assert is_transient(lost.value) and trainer.pid is None

        # the retry (here: a resumed flow's preload): a new child, its trainer loaded from storage
        trainer.preload(0).join(timeout=120)
        second = trainer.pid
        assert second not in (None, first)
        assert not [r for r in caplog.records if "ahead of the update failed" in r.getMessage()], caplog.text
        result, _ = trainer.request("initialize", 0)
        assert result["step"] == 0 and trainer.pid == second
    finally:
        child = trainer.pid
        trainer.close()
    assert child is not None and gone(child)


CHILD_OF_A_DOOMED_PARENT = """
import os, signal, sys
from tasks.run_config import load_config
from tasks.support.trainer_process import TrainerProcess
trainer = TrainerProcess(load_config("configs/tiny.yaml", [f"storage={sys.argv[1]}", "training.mode=process"]))
trainer.request("initialize", 0)
print(trainer.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_trainer_process_exits_when_the_flow_is_killed(tmp_path):
    """A flow killed with SIGKILL leaves no trainer behind that could still write a step the resumed flow redoes."""
    done = subprocess.run([sys.executable, "-c", CHILD_OF_A_DOOMED_PARENT, str(tmp_path / "runs")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    wait_gone(int(done.stdout.split()[0]))


def test_rebuilt_errors():
    assert type(rebuilt_error(error_record(ValueError("bad")), "step 3")) is ValueError
    assert str(rebuilt_error(error_record(ValueError("bad")), "step 3")) == "step 3: bad"
    transient = rebuilt_error(error_record(ConnectionResetError("reset")), "step 3")
    assert isinstance(transient, TransientError) and "ConnectionResetError" in str(transient)
    unknown = rebuilt_error({"type": "nowhere.Missing", "message": "m", "transient": False}, "step 3")
    assert type(unknown) is RuntimeError and str(unknown) == "step 3: nowhere.Missing: m"
    not_an_error = rebuilt_error({"type": "builtins.print", "message": "m", "transient": False}, "step 3")
    assert type(not_an_error) is RuntimeError


def test_plain_output_is_not_taken_for_an_answer():
    assert protocol_line(b'{"result": {"step": 1}, "seconds": {}}\n') == {"result": {"step": 1}, "seconds": {}}
    assert protocol_line(b'{"log": 20, "message": "m"}\n')["log"] == 20
    for line in (b"Loading weights: 100%\n", b"[1, 2]\n", b'{"step": 1}\n', b"\n"):
        assert protocol_line(line) is None, line
