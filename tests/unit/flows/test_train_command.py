"""`trajflow train` as a new user meets it: a summary at the end, trajflow's lines on the console, Prefect's logged."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from backends.inference.adapters import AdapterError
from backends.serving.adapter_sources import AdapterSources
from flows.cli import main
from tests.paths import REPO

TINY = "configs/tiny.yaml"


def _prefect_console_shows(logger: str) -> bool:
    """Whether Prefect's console handler lets an INFO line of `logger` through (pytest holds its stream)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    record = logging.LogRecord(logger, logging.INFO, __file__, 0, "Finished in state Completed()", None, None)
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    return bool(handlers) and all(h.filter(record) for h in handlers)


def _ui_log_lines(summary: str, logger: str) -> list[str]:
    """The lines of `logger` in the Prefect UI's log of the flow run whose page `summary` links to."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs go to the API in the background
    flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", summary).group(1)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs if log.name == logger]


def test_train_ends_with_where_the_run_is_and_what_to_run_next(prefect_api, tmp_path, tiny_model_path, capsys,
                                                                  monkeypatch, command_console):
    monkeypatch.setenv("TRAJFLOW_LOG_DIR", str(tmp_path / "logs"))
    runs = tmp_path / "runs"
    sets = ["--set", f"storage={runs}", "--set", "agent=tests.flow_agents:EchoAgent", "--set", "eval_every=1",
            "--set", "eval_scenarios=2"]
    assert main(["train", TINY, *sets, "--set", "steps=1"]) == 0
    out, err = capsys.readouterr()
    same_run = f"{TINY} {' '.join(sets)}"  # the user's own arguments, `steps` left out
    lines = out.splitlines()
    assert lines[0] == "ci/tiny: at step 1; this run trained step 1 (step 0 is the untrained policy)"
    assert f"  stored in      {runs}/ci/tiny" in lines
    assert re.search(r"^  reward         train \d\.\d{3} at step 1; validation \d\.\d{3} at step 1$", out, re.MULTILINE)
    assert f"  reward curve   {runs}/ci/tiny/reward_curve.png" in lines
    assert (runs / "ci" / "tiny" / "reward_curve.png").exists()
    log_file = tmp_path / "logs" / "ci" / "tiny.log"
    assert f"  log            {log_file}" in lines
    assert re.search(r"^  Prefect UI     http://127\.0\.0\.1:\d+/runs/flow-run/[0-9a-f-]{36}$", out, re.MULTILINE), out
    assert f"  evaluate       trajflow eval {same_run} --policy base --policy @1" in lines
    assert f"  serve it       trajflow serve --model tiny-random --port 8000 --adapter-root {runs}/ci/tiny" in lines
    assert any(line.startswith("  then load it   curl -s http://127.0.0.1:8000/v1/load_lora_adapter") and
               f'"lora_name": "tiny@1", "lora_path": "{runs}/ci/tiny/steps/00001/adapter"' in line for line in lines)
    # the server started as suggested accepts the adapter path suggested (its roots refuse anything else)
    AdapterSources.default([f"{runs}/ci/tiny"]).check(f"{runs}/ci/tiny/steps/00001/adapter")
    with pytest.raises(AdapterError):
        AdapterSources.default().check(f"{runs}/ci/tiny/steps/00001/adapter")
    assert f"  train further  trajflow train {same_run} --set steps=2" in lines
    assert len(lines) < 15 and not out.startswith("{")

    # the console: trajflow's progress lines and the UI link, none of Prefect's own lines
    assert "trajflow: step 1: train/reward=" in err and "trajflow: Prefect UI: http://127.0.0.1:" in err
    assert "Finished in state" not in err and "Beginning flow run" not in err
    log = log_file.read_text()  # ... which are in the run's log file, with the task runs' names
    assert "Finished in state Completed()" in log and "task run 'train-" in log and "step 1: train/reward=" in log

    assert not _prefect_console_shows("prefect.task_runs")
    assert any(line.startswith("step 1: train/reward=") for line in _ui_log_lines(out, "trajflow"))  # and the UI's


    # again: nothing to do, and said so
    assert main(["train", TINY, *sets, "--set", "steps=1"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [(f"ci/tiny: already at step 1; nothing to do; to train further: "
                                 f"trajflow train {same_run} --set steps=2"), f"  stored in      {runs}/ci/tiny"]

    # --json: one line for machines, with the last step's metrics even when nothing was trained
    assert main(["train", TINY, *sets, "--set", "steps=1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["run"], result["step"], result["resumed_from"]) == ("ci/tiny", 1, 1)
    assert "train/reward" in result["metrics"] and result["reward_curve"] == f"{runs}/ci/tiny/reward_curve.png"


def test_a_first_run_on_a_fresh_machine_shows_no_prefect_chatter_unless_verbose(tmp_path, tiny_model_path):
    # its own process on Prefect's temporary server (no PREFECT_API_URL, a new PREFECT_HOME), as `make run` does
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), TRAJFLOW_LOG_DIR=str(tmp_path / "logs"))
    command = [sys.executable, "-m", "flows.train", TINY, "--set", f"storage={tmp_path / 'runs'}", "--set", "steps=0",
               "--set", "agent=tests.flow_agents:EchoAgent"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "ci/tiny: at step 0, the untrained policy"
    console = out.stderr.splitlines()
    assert all(" trajflow: " in line for line in console), out.stderr  # progress lines only
    assert any("trajflow: step 0: the untrained policy, served as tiny@0 (probe max |logprob diff|" in line
               for line in console)
    log = (tmp_path / "logs" / "ci" / "tiny.log").read_text()
    assert "Starting temporary server" in log and "Stopping temporary server" in log

    # --verbose: Prefect's own lines on the console as well
    out = subprocess.run([*command, "--verbose"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ci/tiny: already at step 0; nothing to do; to train further: trajflow train")
    assert "Starting temporary server" in out.stderr and "Finished in state Completed()" in out.stderr
