"""The training flow with the async pipeline (pipeline.max_off_policy_steps=1) in-process on a real Prefect API."""

from __future__ import annotations

from storage.store import RunStore
from tasks.run_config import load_config


def test_async_flow_overlaps_rollouts_with_training_within_the_bound(prefect_api, tmp_path, tiny_model_path):
    """k=1: step s trains on groups sampled by @max(0, s-2); the rollouts of step s+1 run as their own task,
    started before step s's training ended, and so is their scoring; every manifest logs the staleness, at most 1."""
    from prefect import get_client

    from flows.train import train

    config = load_config("configs/tiny.yaml", [
        f"storage={tmp_path / 'runs'}", "agent=tests.flow_agents:EchoAgent", "steps=3", "groups_per_step=2",
        "group_size=3", "pipeline.max_off_policy_steps=1"])
    state = train(config, return_state=True)
    assert state.is_completed(), state
    store = RunStore(config.storage, config.project, config.run)
    assert store.committed_steps() == [0, 1, 2, 3]
    for step, sampled_by in ((1, 0), (2, 0), (3, 1)):
        groups = store.read_groups(step, "scored.parquet")
        assert [g.policy_step for g in groups] == [sampled_by] * 2, step
        assert {t.metadata["policy"] for g in groups for t in g.trajectories} == {f"tiny@{sampled_by}"}
        metrics = store.read_manifest(step).metrics
        assert metrics["pipeline/staleness_max"] == step - 1 - sampled_by <= 1
        assert "train/ratio_mean" in metrics and "train/mismatch_kl" in metrics

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs() if r.flow_run_id == state.state_details.flow_run_id]
    rollouts = {r.name: r for r in runs if r.name.startswith("rollouts-")}
    scores = {r.name: r for r in runs if r.name.startswith("score-")}
    trainings = sorted((r for r in runs if r.name.startswith("train-")), key=lambda r: r.start_time)
    assert sorted(rollouts) == ["rollouts-step-1", "rollouts-step-2", "rollouts-step-3"] and len(trainings) == 3
    # submitted before step 1's scoring began; step 1's training (the trainer's first load) takes seconds
    assert rollouts["rollouts-step-2"].start_time < trainings[0].end_time
    assert rollouts["rollouts-step-3"].start_time > trainings[0].end_time  # its policy, tiny@1, came after
    # each step scored once, as soon as its rollouts were stored: step 2's while step 1 trained
    assert sorted(scores) == ["score-step-1", "score-step-2", "score-step-3"]
    assert all(scores[f"score-step-{s}"].start_time >= rollouts[f"rollouts-step-{s}"].end_time for s in (1, 2, 3))
    assert scores["score-step-2"].end_time < trainings[0].end_time
