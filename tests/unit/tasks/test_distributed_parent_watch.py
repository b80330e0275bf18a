"""Training ranks do not outlive the process that launched them (tasks/support/distributed_training.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from tasks.support.distributed_training import ORPHANED_EXIT, PARENT_ENV, exit_when_gone


def test_distributed_rank_exits_once_its_launcher_is_gone():
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = threading.Event()
    codes = []

    def record(code):
        codes.append(code)
        exited.set()

    exit_when_gone(launcher.pid, exit=record, poll_s=0.05)
    assert not exited.wait(0.3)  # alive: keeps training
    launcher.kill()
    launcher.wait()
    assert exited.wait(5) and codes == [ORPHANED_EXIT]


def test_distributed_a_busy_process_watching_a_killed_launcher_ends_with_the_orphan_code():
    """In a process of its own (os._exit, as a rank uses it) whose main thread is busy, as a training rank's is."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = ("import os, sys, time; from tasks.support.distributed_training import exit_when_gone, PARENT_ENV; "
            "exit_when_gone(int(os.environ[PARENT_ENV]), poll_s=0.05); time.sleep(60)")
    rank = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, PARENT_ENV: str(launcher.pid)})
    launcher.kill()
    launcher.wait()
    assert rank.wait(timeout=10) == ORPHANED_EXIT
