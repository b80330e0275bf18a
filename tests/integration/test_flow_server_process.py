"""The training flow with the embedded server in its own process (inference.embedded_process), tiny-random, on a
real Prefect API: separate processes (one per replica) that the flow hot-loads and probes and stops at the end, at k=0
and k=1; killed with SIGKILL mid-rollouts, it fails the rollouts task with its exit code and log tail, and the retry
restarts it."""

from __future__ import annotations

import logging
import os
import re

import pytest

from storage.store import RunStore
from tasks.run_config import load_config

STARTED = re.compile(r"the embedded server \(pid (\d+)\) answers at (\S+)")


def _config(tmp_path, *sets: str):
    return load_config("configs/tiny.yaml", [
        f"storage={tmp_path / 'runs'}", "agent=tests.flow_agents:EchoAgent", "steps=2", "groups_per_step=2",
        "group_size=3", "inference.embedded_process=true", *sets])


@pytest.fixture
def run_log(tmp_path, monkeypatch):
    """Messages of the `trajflow` logger and of Prefect's task-run logger (inside a flow neither reaches pytest's
    caplog); the run's log files go under the test's folder."""
    monkeypatch.setenv("TRAJFLOW_LOG_DIR", str(tmp_path / "logs"))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.INFO)
    loggers = [logging.getLogger(name) for name in ("trajflow", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    yield lines
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def _started(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := STARTED.search(line))]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _check_trained(config, sampled_by: dict[int, int]) -> None:
    store = RunStore(config.storage, config.project, config.run)
    assert store.committed_steps() == [0, 1, 2]
    for step, policy in sampled_by.items():
        # sampled under <run>@<policy>: the server process had that adapter hot-loaded (it answers 404 otherwise)
        groups = store.read_groups(step, "scored.parquet")
        assert {t.metadata["policy"] for g in groups for t in g.trajectories} == {f"tiny@{policy}"}
        metrics = store.read_manifest(step).metrics
        assert metrics["publish/probe_max_abs_diff"] <= metrics["publish/probe_tolerance"]  # the probe passed


def test_async_flow_with_the_server_in_its_own_process(prefect_api, tmp_path, tiny_model_path, run_log):
    from flows.train import train

    config = _config(tmp_path, "pipeline.max_off_policy_steps=1", "inference.replicas=2")
    state = train(config, return_state=True)
    assert state.is_completed(), state
    pids = _started(run_log)
    assert len(set(pids)) == 2 and os.getpid() not in pids  # a process per replica, not this one
    assert all(_gone(pid) for pid in pids)  # stopped with the flow
    _check_trained(config, {1: 0, 2: 0})  # k=1: step 2 sampled by @0
    assert RunStore(config.storage, config.project, config.run).read_manifest(2).metrics["publish/replicas"] == 2


def test_a_killed_server_fails_the_rollouts_task_and_the_retry_restarts_it(prefect_api, tmp_path, tiny_model_path,
                                                                           run_log):
    from prefect import get_client

    from flows.train import train

    marker = tmp_path / "killed"
    config = _config(tmp_path, "agent=tests.flow_agents:KillsServerOnce", "rollouts.max_failure_fraction=0",
                     f"agent_options={{marker: {marker}, at_policy: tiny@1}}")
    state = train(config, return_state=True)
    assert state.is_completed(), state
    first, second = _started(run_log)
    assert marker.read_text() == str(first) and second != first and _gone(first) and _gone(second)
    _check_trained(config, {1: 0, 2: 1})
    assert any("loaded it from storage" in line for line in run_log)  # the restarted server got tiny@1 back before the retry sampled

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs() if r.flow_run_id == state.state_details.flow_run_id]
    [rollouts] = [r for r in runs if r.name == "rollouts-step-2"]
    assert rollouts.run_count == 2  # failed once, then Prefect's retry
    [failed] = [line for line in run_log if line.startswith("Task run failed with exception: TransientError")]
    assert f"the embedded server (pid {first}, " in failed and "exited with code -9" in failed
    assert "trajflow serve: tiny-random at http://127.0.0.1:" in failed  # the log tail
    assert "Retry 1/3" in failed


def test_a_server_that_cannot_start_is_one_clear_error(tmp_path, tiny_model_path, run_log):
    from backends.serving.managed_process import ServerStartError
    from tasks.support.runtime import Runtime

    runtime = Runtime(_config(tmp_path, "inference.device=cuda:0"))  # the flow's placement check would come first
    with pytest.raises(ServerStartError) as e:
        runtime.ensure_server()
    message = str(e.value)
    assert "the embedded server exited with code 2 before becoming healthy" in message
    assert "trajflow serve: --device cuda:0: CUDA is not available here" in message
    assert runtime.api_key not in message and runtime._servers == []


def test_the_key_goes_in_the_environment_and_the_command_covers_the_adapter_cache(tmp_path, tiny_model_path, run_log):
    from backends.policy.publish import adapter_cache
    from tasks.support.embedded_launch import embedded_process

    config = _config(tmp_path, "inference.max_loras=3", "inference.overlap_decode=off",
                     "inference.engine.compile_decode=on", "inference.engine.admission_wait_steps=2")
    server = embedded_process(config, "s3cret-key", "cpu", 0, replica=1)
    argv, env = server.argv(1234), server.environment({"PYTHONPATH": "/elsewhere", "TRAJFLOW_API_KEY": "stale"})
    assert "s3cret-key" not in " ".join(argv) and env["TRAJFLOW_API_KEY"] == "s3cret-key"
    assert argv[argv.index("--adapter-root") + 1] == str(adapter_cache(config.project, config.run))
    assert argv[argv.index("--model") + 1] == str(tiny_model_path) and "--quiet" in argv
    assert [argv[argv.index(f) + 1] for f in ("--served-name", "--device", "--max-loras", "--overlap-decode",
                                              "--port")] == ["tiny-random", "cpu", "3", "off", "1234"]
    engine = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--engine"]
    assert engine == ["compile_decode=true", "admission_wait_steps=2"]  # YAML's on is a bool: serve reads 'true'
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/elsewhere"]  # this checkout first
    assert server.log_path == tmp_path / "logs" / "ci" / "tiny.embedded-1.log"
    assert "TRAJFLOW_API_KEY" not in embedded_process(config, None, "cpu", 0).environment({"TRAJFLOW_API_KEY": "x"})


def test_overlap_decode_reaches_the_engine_of_a_server_on_a_thread(tmp_path):
    """`inference.overlap_decode` is the way back to the serial decode loop for the in-process server too."""
    from tasks.support.runtime import Runtime

    for value, overlap in (("on", True), ("auto", False)):  # auto: off on the CPU (no CUDA graphs)
        runtime = Runtime(_config(tmp_path, "inference.embedded_process=false", f"inference.overlap_decode={value}"))
        try:
            runtime.ensure_server()
            assert runtime._servers[0].engine.overlap is overlap
        finally:
            runtime.close()
