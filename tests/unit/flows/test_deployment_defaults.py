"""`prefect deployment run train/ui -p config='{...}'` with a partial config: the rest comes from the deployment."""

from __future__ import annotations

from storage.store import RunStore
from tasks.run_config import RunConfig


def test_overlay_writes_only_the_fields_the_caller_set():
    from flows.deployment_defaults import overlay

    defaults = {"run": "nightly", "steps": 50, "eval_every": 5,
                "training": {"mode": "deployment", "deployment": "train-step/gpu"}, "trainer": {"lora_rank": 4}}
    given = RunConfig.model_validate({"steps": 60, "trainer": {"learning_rate": 1e-4}})
    assert overlay(defaults, given) == {**defaults, "steps": 60, "trainer": {"lora_rank": 4, "learning_rate": 1e-4}}
    assert overlay(defaults, RunConfig.model_validate(defaults)) == defaults


def test_a_partial_config_run_from_a_deployment_keeps_the_deployments_settings(prefect_api, tmp_path,
                                                                                tiny_model_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from flows.train import train

    monkeypatch.chdir(tmp_path)  # were the deployment's storage lost, the run would land in ./runs, here
    defaults = {"project": "deployed", "run": "ui-run", "agent": "tests.flow_agents:EchoAgent",
                "base_model": "tiny-random", "storage": str(tmp_path / "store"), "steps": 3, "groups_per_step": 2,
                "group_size": 2, "trainer": {"lora_rank": 4, "lora_alpha": 8}}
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("train")
        deployment_id = client.create_deployment(flow_id=flow_id, name=f"ui-{tmp_path.name}",
                                                 entrypoint="flows/train.py:train", parameters={"config": defaults})
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters={"config": {"steps": 0}})
    assert flow_run.parameters == {"config": {"steps": 0}}  # Prefect replaced the whole config parameter

    result = run_flow(train, flow_run=flow_run)  # what a worker does with the flow run

    assert result["step"] == 0
    store = RunStore(str(tmp_path / "store"), "deployed", "ui-run")
    stored = store.read_run_config()
    assert (stored["steps"], stored["agent"], stored["trainer"]["lora_rank"]) == (0, "tests.flow_agents:EchoAgent", 4)
    assert store.committed_steps() == [0]
    assert not (tmp_path / "runs").exists()
