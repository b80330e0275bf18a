"""benchmarks/vllm_kill.py's process finding: it must kill exactly the `serve` process groups below the flow (the
launcher starts vLLM in a session of its own), never the flow itself or an unrelated process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import vllm_kill

SLEEPER = "import sys, time; time.sleep(60)"


def _both_started(found: dict[int, str]) -> bool:
    return sorted(cmd.split()[-1] for cmd in found.values() if SLEEPER in cmd) == ["model", "other"]


def test_finds_the_serve_group_below_a_process_and_nothing_else():
    # a stand-in "flow": it starts a `serve` child in a new session (like the launcher) and a plain child
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, 'serve', 'model'], start_new_session=True)\n"
        f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, 'other'])\n"
        "time.sleep(60)\n")])
    try:
        deadline = time.time() + 20
        # both children exec'd: a child just forked still shows its parent's command line, without 'serve'
        while not _both_started(vllm_kill.descendants(parent.pid)) and time.time() < deadline:
            time.sleep(0.05)
        found = vllm_kill.descendants(parent.pid)
        assert len(found) == 2
        leaders = vllm_kill.vllm_leaders(parent.pid)
        assert len(leaders) == 1 and " serve model" in found[leaders[0]]
        assert parent.pid not in leaders and os.getpgid(leaders[0]) == leaders[0]
    finally:
        for pid in vllm_kill.descendants(parent.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        parent.kill()
        parent.wait()


def test_kill_at_outside_the_run_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        vllm_kill.main(["--steps", "2", "--kill-at", "3"])
    assert exc.value.code == 2 and "--kill-at must be a step of the run (1..2)" in capsys.readouterr().err
