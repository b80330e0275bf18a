"""Experiment tracking (agents/tracking/): W&B offline and Trackio for real, read back; Weave against a recording
stand-in, because Weave needs a W&B server and has no offline mode."""

from __future__ import annotations

import inspect
import os
import sys
import types
from pathlib import Path

import pytest

from agents.tracking import RunTracker, TrackingConfig, TrackingError
from agents.tracking.samples import sample_rows
from agents.trajectory import Trajectory, TrajectoryGroup
from tests.fixtures_tracking import trackio_logs, trackio_runs, wandb_offline_runs

SECRET = "wb-key-0123456789abcdef0123456789abcdef"


def _group(scenario: str, *texts: str) -> TrajectoryGroup:
    return TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": scenario},
                                                             {"role": "assistant", "content": t}],
                                       reward=float(i)) for i, t in enumerate(texts)], scenario_id=scenario)


def _files_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def test_one_wandb_run_per_trajflow_run_resumed_with_step_axis_config_and_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    project = f"unit-{tmp_path.name}"
    cfg = TrackingConfig.model_validate({"wandb": {"mode": "offline"}, "trackio": {"project": project},
                                         "sample_trajectories": 3})
    where = {"project": "proj", "run": "agent-001", "run_url": str(tmp_path / "runs/proj/agent-001"),
             "run_config": {"trainer": {"learning_rate": 1e-5}, "seed": 3}}
    tracker = RunTracker(cfg, **where)
    tracker.log_step(1, {"train/reward": 0.25}, [_group("s1", "a", "b"), _group("s2", f"key {SECRET}")])
    tracker.log_metrics(1, {"val/reward": 0.5})
    tracker.finish()
    resumed = RunTracker(cfg, **where)  # a new process continuing the run
    resumed.log_step(2, {"train/reward": 0.75}, [_group("s1", "c")])
    resumed.finish()

    runs = wandb_offline_runs(tmp_path / "wandb")
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id and runs[0].name == "agent-001"
    assert runs[0].project == "proj" and runs[0].config["seed"] == 3
    rows = [row for r in runs for row in r.history]
    assert [(row["step"], row.get("train/reward"), row.get("val/reward")) for row in rows] == [
        (1, 0.25, None), (1, None, 0.5), (2, 0.75, None)]
    assert rows[0]["trajectories/nrows"] == 3 and rows[2]["trajectories/nrows"] == 1
    table = next(runs[0].folder.rglob("trajectories_*.table.json")).read_text()
    assert "[redacted]" in table and '"scenario"' in table
    assert trackio_runs(project) == ["agent-001"]
    assert [(r["step"], r.get("train/reward")) for r in trackio_logs(project, "agent-001")] == [
        (1, 0.25), (1, None), (2, 0.75)]
    assert SECRET not in _files_text(tmp_path / "wandb") + _files_text(Path(os.environ["TRACKIO_DIR"]))


def test_rows_take_every_group_before_any_twice_and_redact_credentials(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-abcdefgh12345")
    rows = sample_rows(4, [_group("s1", "a", "b", "c"), _group("s2", "tok-abcdefgh12345 leaked")], 3)
    assert [(r[0], r[1], r[2]) for r in rows] == [(4, "s1", 0.0), (4, "s2", 0.0), (4, "s1", 1.0)]
    assert rows[1][3] == "user: s2\nassistant: [redacted] leaked"


def test_a_tracker_that_cannot_start_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    with pytest.raises(TrackingError, match=r"tracking: cannot start wandb for run p/r: ModuleNotFoundError.*"
                                            r"pip install 'trajflow\[tracking\]'"):
        RunTracker(TrackingConfig.model_validate({"wandb": {}}), project="p", run="r", run_url="x")
    assert not RunTracker(None, project="p", run="r", run_url="x").active


# Weave 0.54's own signatures of what trajflow calls (weave.init, weave.op); the stand-in accepts only these.
WEAVE_INIT_KWARGS = {"settings", "autopatch_settings", "postprocess_inputs", "postprocess_output", "attributes"}
WEAVE_OP_KWARGS = {"name", "call_display_name", "postprocess_inputs", "postprocess_output", "tracing_sample_rate",
                   "enable_code_capture", "accumulator", "kind", "color", "attributes", "eager_call_start"}


@pytest.fixture
def recording_weave(monkeypatch):
    """A `weave` module that records init and op calls and each traced call's cleaned inputs and output."""
    from agents.tracking import weave_ops

    calls: dict[str, list] = {"init": [], "op": [], "traced": []}

    def init(project_name, **kwargs):
        assert set(kwargs) <= WEAVE_INIT_KWARGS
        calls["init"].append(project_name)

    def op(func, **kwargs):
        assert set(kwargs) <= WEAVE_OP_KWARGS and inspect.iscoroutinefunction(func)

        async def wrapper(*args, **kw):
            bound = inspect.signature(func).bind(*args, **kw)
            result = await func(*args, **kw)
            calls["traced"].append((kwargs["name"], kwargs["postprocess_inputs"](dict(bound.arguments)),
                                    kwargs["postprocess_output"](result)))
            return result

        calls["op"].append(kwargs["name"])
        return wrapper

    monkeypatch.setitem(sys.modules, "weave", types.SimpleNamespace(init=init, op=op))
    monkeypatch.setattr(weave_ops, "_weave", None)
    monkeypatch.setattr(weave_ops, "_project", None)
    monkeypatch.setattr(weave_ops, "_ops", {})
    return calls


async def test_weave_traces_rollouts_and_judge_calls_without_token_data(recording_weave, judge_server, monkeypatch):
    from agents.judge import JudgeConfig, ruler_score_group
    from agents.tracking.weave_ops import traced
    from tests.fixtures_judge import scores_json

    monkeypatch.setenv("SOME_API_KEY", "sk-weave-secret-999")

    async def rollout(scenario):
        return Trajectory(messages_and_choices=[{"role": "user", "content": scenario + " sk-weave-secret-999"}],
                          reward=1.0)

    assert traced(rollout, "rollout") is rollout  # Weave not configured: nothing wraps
    RunTracker(TrackingConfig.model_validate({"weave": {"project": "team/agents"}}), project="p", run="r",
               run_url="x")
    assert recording_weave["init"] == ["team/agents"]
    traj = await traced(rollout, "rollout")("2+2?")
    assert traced(rollout, "rollout") is traced(rollout, "rollout")  # one op per function
    judge_server.script(scores_json({"t1": 0.2, "t2": 0.9}))
    await ruler_score_group(_group("s1", "a", "b"), config=JudgeConfig(model="j", base_url=judge_server.base_url))

    (name, inputs, output), judge = recording_weave["traced"]
    assert name == "rollout" and inputs == {"scenario": "2+2?"} and output["reward"] == traj.reward == 1.0
    assert output["messages_and_choices"][0]["content"] == "2+2? [redacted]"
    assert judge[0] == "judge" and recording_weave["op"] == ["rollout", "judge"]
    assert "sk-weave-secret-999" not in repr(recording_weave)
