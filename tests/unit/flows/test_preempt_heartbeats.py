"""Heartbeats on for every training deployment (prefect.yaml), at a frequency Prefect accepts and the README states."""

from __future__ import annotations

import yaml
from prefect.settings.models.flows import FlowsSettings

from tests.paths import REPO

TRAINING_ENTRYPOINTS = {"flows/train.py:train", "flows/train_step.py:train_step"}


def test_preempt_training_deployments_send_heartbeats_at_the_documented_frequency():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    training = [d for d in spec["deployments"] if d["entrypoint"] in TRAINING_ENTRYPOINTS]
    assert {d["entrypoint"] for d in training} == TRAINING_ENTRYPOINTS
    frequencies = set()
    for deployment in training:
        env = deployment["work_pool"].get("job_variables", {}).get("env", {})
        raw = env.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
        assert isinstance(raw, str), f"{deployment['name']}: env.PREFECT_FLOWS_HEARTBEAT_FREQUENCY must be a string"
        # what the flow-run process does with it: Prefect's own settings model validates it (>= 30 s)
        frequencies.add(FlowsSettings(heartbeat_frequency=raw).heartbeat_frequency)
    assert frequencies == {30}
    deploying = (REPO / "README.md").read_text().split("## Deploying", 1)[1].split("\n## ", 1)[0]
    assert "`PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30`" in deploying
