"""The training flow in-process on a real Prefect API (test harness), tiny-random, local storage."""

from __future__ import annotations

import pytest

from storage.store import RunStore
from tasks.rollouts import RolloutFailures
from tasks.run_config import load_config


def _config(tmp_path, **overrides):
    sets = [f"storage={tmp_path / 'runs'}", "agent=tests.flow_agents:EchoAgent", "steps=2",
            "groups_per_step=2", "group_size=3"]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    return load_config("configs/tiny.yaml", sets)


def test_flow_trains_commits_and_continues(prefect_api, tmp_path, tiny_model_path, monkeypatch):
    from flows.train import train
    from tests.fixtures_tracking import trackio_logs, trackio_runs, wandb_offline_runs

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    trackio_project = f"flow-{tmp_path.name}"
    config = _config(tmp_path, eval_every=2, eval_at_start="true", **{"tracking.wandb.mode": "offline",
                                                                      "tracking.trackio.project": trackio_project})
    result = train(config)
    store = RunStore(config.storage, config.project, config.run)
    assert store.committed_steps() == [0, 1, 2] and result["step"] == 2
    m2 = store.read_manifest(2).metrics
    for key in ("train/reward", "train/loss", "val/reward", "time/step_s", "publish/probe_max_abs_diff"):
        assert key in m2, key
    assert m2["publish/probe_max_abs_diff"] <= m2["publish/probe_tolerance"] == 0.05  # float32 trainer: auto
    # the train stage explained: Prefect around the task's body; the body: loading, the step's parts, the rest
    split = ("time/train_task_s", "time/train_orchestration_s", "time/train_load_s", "time/train_other_s")
    assert all(m2[k] >= 0 for k in split) and m2["train/probe_forwards"] <= 17
    assert m2["time/train_task_s"] + m2["time/train_orchestration_s"] == pytest.approx(m2["time/train_s"])
    assert m2["time/train_load_s"] + m2["train/stage_s"] + m2["time/train_other_s"] == pytest.approx(
        m2["time/train_task_s"])
    assert "val/reward" in store.read_manifest(0).metrics
    assert store.get_bytes(None, "reward_curve.png").startswith(b"\x89PNG")
    assert len(store.read_groups(2, "scored.parquet")) == 2
    # the same config again: nothing to do; one more step: continues from the stored checkpoint
    assert train(config)["step"] == 2
    assert train(config.model_copy(update={"steps": 3}))["step"] == 3
    assert store.committed_steps() == [0, 1, 2, 3]
    # tracked: one W&B run (resumed by its id, not duplicated) and one Trackio run, every committed step at x = step
    runs = wandb_offline_runs(tmp_path / "wandb")
    assert len(runs) == 2 and len({r.run_id for r in runs}) == 1 and runs[0].name == "tiny"
    assert runs[0].config["trainer"]["learning_rate"] == config.trainer.learning_rate
    rows = [row for r in runs for row in r.history]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[3]["train/reward"] == store.read_manifest(3).metrics["train/reward"]
    assert rows[1]["trajectories/_type"] == "table-file" and rows[1]["trajectories/nrows"] == 4  # of 2 x 3
    assert trackio_runs(trackio_project) == ["tiny"]
    assert [row["step"] for row in trackio_logs(trackio_project, "tiny")] == [0, 1, 2, 3]


def test_changed_identity_is_refused(prefect_api, tmp_path, tiny_model_path):
    from flows.train import train

    config = _config(tmp_path, steps=0)
    train(config)
    with pytest.raises(ValueError, match="group_size"):
        train(config.model_copy(update={"group_size": 5}))


def test_failed_rollouts_and_nan_rewards_are_recorded_not_trained(prefect_api, tmp_path, tiny_model_path):
    from flows.train import train

    config = _config(tmp_path, steps=1, group_size=4, **{"agent_options.fail_every": 5,
                                                          "agent_options.nan_every": 3})
    train(config)
    store = RunStore(config.storage, config.project, config.run)
    groups = store.read_groups(1, "scored.parquet")
    exceptions = [e for g in groups for e in g.exceptions]
    assert exceptions and all("simulated tool crash" in e.message for e in exceptions)
    nan_marked = [t for g in groups for t in g.trajectories if t.error]
    assert nan_marked and all("finite" in t.error for t in nan_marked)
    assert store.read_manifest(1).metrics["train/failed"] == len(exceptions) + len(nan_marked)


def test_too_many_failures_fail_the_step_with_the_first_errors(prefect_api, tmp_path, tiny_model_path):
    from flows.train import train

    config = _config(tmp_path, steps=1, agent="tests.flow_agents:AlwaysFails")
    with pytest.raises(RolloutFailures, match="cannot answer train-"):
        train(config)
    assert RunStore(config.storage, config.project, config.run).committed_steps() == [0]


def test_flow_uses_the_judge_from_config_and_caches_it(prefect_api, tmp_path, tiny_model_path, judge_server):
    import re

    from agents.registry import get_agent
    from flows.train import train
    from storage.layout import GROUPS_DIR, group_file
    from tasks.scenarios import pick_train_scenarios
    from tasks.scoring import score_groups_fn
    from tests.fixtures_judge import scores_json

    def reply(body):
        ids = re.findall(r'<trajectory id="(t\d+)">', body["messages"][-1]["content"])
        return scores_json({t: (1.0 if t == "t1" else 0.25) for t in ids})

    judge_server.script(*[reply] * 4)
    config = _config(tmp_path, steps=1, **{"judge.model": "judge-model", "judge.base_url": judge_server.base_url,
                                           "judge.use_json_schema": "false"})
    train(config)
    assert len(judge_server.chat_requests) == 2  # one per group
    store = RunStore(config.storage, config.project, config.run)
    for group in store.read_groups(1, "scored.parquet"):
        assert [t.reward for t in group.trajectories] == [1.0, 0.25, 0.25]  # replace mode, matched by id
        assert all("independent_reward" in t.metrics and t.metrics["judge_cache_hit"] == 0
                   for t in group.trajectories)
    # re-scoring the same step (a resumed task) is served from the judge cache in storage: no request
    pool = get_agent(config.agent).scenarios("train", 0)
    scenarios = pick_train_scenarios(pool, config.seed, 1, config.groups_per_step)
    rescored = score_groups_fn(config, 1, scenarios, {"paths": [group_file(GROUPS_DIR, i) for i in range(2)]},
                               out="rescored.parquet")
    assert len(judge_server.chat_requests) == 2
    assert rescored["metrics"]["train/judge_cache_hit"] == 1.0
    assert store.read_manifest(1).metrics["train/reward"] == rescored["metrics"]["train/reward"]


@pytest.mark.parametrize("agent", ["arithmetic", "tictactoe", "research"])
def test_each_example_agent_trains_one_step(agent, prefect_api, tmp_path, tiny_model_path):
    from flows.train import train

    config = load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", f"agent={agent}", "steps=1",
                                                "groups_per_step=2", "group_size=2", f"run=tiny-{agent}"])
    assert train(config)["step"] == 1
    store = RunStore(config.storage, config.project, config.run)
    groups = store.read_groups(1, "scored.parquet")
    assert len(groups) == 2 and all(len(g.trajectories) == 2 for g in groups)  # garbage is scored, not raised
    assert all(t.messages_and_choices[-1] for g in groups for t in g.trajectories)
