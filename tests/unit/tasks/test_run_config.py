"""RunConfig: YAML, --set overrides, validation errors that name the problem; the scenario cursor."""

import pytest

from agents.scenario import Scenario
from tasks.run_config import RunConfig, apply_overrides, check_run_identity, load_config
from tasks.scenarios import pick_train_scenarios


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: a\nsteps: 2\ntrainer:\n  lora_rank: 4\n")
    cfg = load_config(path, ["steps=3", "run=try-2", "storage=/data/runs", "trainer.lora_rank=8",
                             "rollouts.concurrency=4", "judge=null"])
    assert (cfg.steps, cfg.run, cfg.storage, cfg.trainer.lora_rank, cfg.rollouts.concurrency) == (
        3, "try-2", "/data/runs", 8, 4)
    assert cfg.judge is None
    assert cfg.policy(3) == "try-2@3"
    assert load_config(None).run == "default"


def test_shipped_configs_load():
    assert load_config("configs/tiny.yaml").base_model == "tiny-random"
    assert load_config("configs/default.yaml").base_model == "smollm2-135m"


@pytest.mark.parametrize("override, match", [
    ("steps", "key=value"),
    ("nosuchfield=1", "nosuchfield"),
    ("steps=-1", "steps"),
    ("run=../escape", "run"),
    ("project=a/b", "project"),
    ("steps.x=1", "steps"),
])
def test_bad_overrides_are_named(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_config(bad)


def test_config_round_trips_as_flow_parameter():
    cfg = load_config("configs/tiny.yaml", ["steps=5"])
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert "trainer" in RunConfig.model_json_schema()["properties"]
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}
    with pytest.raises(ValueError, match="not a section"):
        apply_overrides({"steps": 3}, ["steps.x=1"])


def test_scenario_cursor_is_a_function_of_seed_and_step():
    pool = [Scenario(id=f"s{i}") for i in range(5)]
    steps = [[s.id for s in pick_train_scenarios(pool, seed=3, step=k, count=2)] for k in range(1, 6)]
    again = [[s.id for s in pick_train_scenarios(pool, seed=3, step=k, count=2)] for k in range(1, 6)]
    assert steps == again
    flat = [i for chunk in steps for i in chunk]
    assert sorted(flat[:5]) == [f"s{i}" for i in range(5)]  # one epoch covers every scenario once
    assert sorted(flat[5:10]) == [f"s{i}" for i in range(5)]
    assert flat[:5] != flat[5:10]  # the next epoch is reshuffled
    with pytest.raises(ValueError, match="no train scenarios"):
        pick_train_scenarios([], 0, 1, 2)


def test_agent_metrics_never_overwrite_trainer_metrics():
    from agents.group_metrics import merge_step_metrics

    merged = merge_step_metrics({"train/reward": 0.5, "train/loss": 3.0}, {"train/loss": -0.1}, {"publish/x": 1.0})
    assert merged == {"train/reward": 0.5, "train/loss": -0.1, "train/loss.agent": 3.0, "publish/x": 1.0}


def test_run_identity_refuses_what_defines_the_run_and_ignores_new_fields():
    config = load_config("configs/tiny.yaml")
    stored = config.model_dump(mode="json")
    stored["trainer"].pop("lora_dropout")  # a run written before this field existed
    check_run_identity(stored, config)
    stored["trainer"].update(micro_batch_tokens=7, memory_efficient_ops=False, learning_rate=0.5)
    check_run_identity(stored, config)  # batching, kernels, the learning rate may change on resume
    for change in ({"lora_rank": 99}, {"seed": 7}, {"lora_dropout": 0.1}):  # the adapter's shape, seed, dropout
        with pytest.raises(ValueError, match="different trainer"):
            check_run_identity({**stored, "trainer": {**stored["trainer"], **change}}, config)
    for field, value in (("group_size", 9), ("agent", "other")):
        with pytest.raises(ValueError, match=f"different {field}"):
            check_run_identity({**stored, field: value}, config)
