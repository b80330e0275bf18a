"""Publishing when the update ran elsewhere (training.mode=deployment): the flow process holds no trainer for the
step it publishes, so it checks the server against the probe record the GPU-side `train_step` flow wrote
(real Prefect API, real embedded server, tiny-random). A training.json without a record is checked by asking
that the new policy answer differently from the previous one."""

from __future__ import annotations

import asyncio

from agents.trajectory import Trajectory, TrajectoryGroup
from backends.policy.probe import PROBE_TOKENS
from storage.layout import SCORED, TRAINING_RESULT
from tasks.publish import publish_policy_fn
from tasks.run_config import load_config
from tasks.support.runtime import close_runtime, get_runtime
from tasks.training import initialize_policy_fn

STRONG = ("publish/probe_max_abs_diff", "publish/probe_mean_abs_diff", "publish/probe_tolerance",
          "publish/probe_common_prefix")


def _config(tmp_path, run: str):
    return load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", f"run={run}", "training.mode=deployment",
                                             "agent=tests.flow_agents:EchoAgent", "trainer.learning_rate=0.05"])


async def _scored_groups(rt, policy: str) -> list[TrajectoryGroup]:
    """Rollouts of `policy` through the run's own server and policy client, with spread rewards."""
    client = rt.client()
    try:
        groups = []
        for q in range(2):
            messages = [{"role": "user", "content": f"Question {q}?"}]
            r = await client.chat.completions.create(model=policy, messages=messages, n=3, max_tokens=6, seed=q)
            groups.append(TrajectoryGroup([Trajectory(messages_and_choices=[*messages, c], reward=float(i))
                                           for i, c in enumerate(r.choices)], scenario_id=f"s{q}"))
        return groups
    finally:
        await client.close()


def test_deployment_mode_publish_checks_the_workers_probe_record(prefect_api, tmp_path, tiny_model_path):
    from flows.train_step import train_step

    config = _config(tmp_path, "remote")
    try:
        training = initialize_policy_fn(config)
        assert training["probe"]["source"] == "probe-messages"
        zero = publish_policy_fn(config, 0, training)["metrics"]
        assert set(STRONG) <= set(zero) and zero["publish/probe_common_prefix"] == PROBE_TOKENS
        rt = get_runtime(config)
        rt.store.write_groups(1, SCORED, asyncio.run(_scored_groups(rt, config.policy(0))))
        result = train_step(config, 1)  # the GPU-side flow, here in this process
        assert result["probe"]["source"] == "trained-turn" and result["metrics"]["train/probe_shift"] > 0.05
        one = publish_policy_fn(config, 1, rt.store.get_json(1, TRAINING_RESULT))["metrics"]
        assert one["publish/probe_max_abs_diff"] < 1e-3 and one["publish/probe_tolerance"] == 0.05
        # a training.json without a probe record, no trainer in this process: the answers must change
        unrecorded = {k: v for k, v in rt.store.get_json(1, TRAINING_RESULT).items() if k != "probe"}
        changed = publish_policy_fn(config, 1, unrecorded)["metrics"]
        assert changed == {"publish/probe_changed": 1.0}
    finally:
        close_runtime(config)
