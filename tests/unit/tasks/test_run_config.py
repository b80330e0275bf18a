"""RunConfig: YAML, --set overrides, validation errors that name the problem; the form Prefect renders; the cursor."""

import html
import re

import pytest

from agents.scenario import Scenario
from tasks.config_errors import ConfigError
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
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
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


@pytest.mark.parametrize("overrides, lines", [
    (["stpes=3"], ["stpes: unknown key; did you mean steps?"]),
    (["trainer.learnig_rate=1e-4"], ["trainer.learnig_rate: unknown key; did you mean trainer.learning_rate?"]),
    (["learning_rate=1e-4"], ["learning_rate: unknown key; did you mean trainer.learning_rate?"]),
    (["judge.modle=x"], ["judge.modle: unknown key; did you mean judge.model?"]),
    (["rewards.components=[{nme: a}]"], [
        "rewards.components[0].name: required",
        "rewards.components[0].nme: unknown key; did you mean rewards.components[0].name?"]),
    (["zzz=1"], ["zzz: unknown key"]),
    (["steps=-1", "group_size=x"], ["steps: input should be greater than or equal to 0, got -1",
                                    ("group_size: input should be a valid integer, unable to parse string as an "
                                     "integer, got 'x'")]),
    (["trainer.target_modules=q"], [("trainer.target_modules: input should be 'all-linear' or input should be a "
                                     "valid list, got 'q'")]),
    (["trainer.lr_schedule=cosine"], ["trainer: lr_schedule='cosine' needs total_steps"]),
])
def test_config_mistakes_are_one_line_each_with_the_key_meant(overrides, lines):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert caught.value.problems == lines
    assert "\n".join(lines) == str(caught.value)  # no pydantic block, no errors.pydantic.dev link


def test_a_dotted_key_in_yaml_is_told_to_nest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer.lora_rank: 4\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "'trainer.lora_rank': unknown key; in YAML nest it (trainer: {lora_rank: ...}), dotted keys are for --set"]


def _descriptions(node, where=""):
    """(json path, description) of every description in a JSON schema."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                yield where, value
            else:
                yield from _descriptions(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _descriptions(value, f"{where}/{i}")


def _rendered_text(markdown: str) -> str:
    """What a CommonMark renderer shows of `markdown`: tags dropped, entities decoded."""
    from markdown_it import MarkdownIt

    return html.unescape(re.sub(r"<[^>]+>", "", MarkdownIt("commonmark").renderInline(markdown)))


def _prefect_form_schema() -> dict:
    """The schema the Prefect UI builds the `train` deployment's form from."""
    from prefect.utilities.callables import parameter_schema

    from flows.train import train

    return parameter_schema(train.fn).model_dump_for_openapi()


def test_every_description_renders_in_the_prefect_form_as_written():
    descriptions = list(_descriptions(_prefect_form_schema()))
    assert len(descriptions) > 80  # RunConfig and every nested model, TrainerConfig, JudgeConfig, RewardConfig
    for where, text in descriptions:
        outside_code = re.sub(r"`[^`]*`", "", text)
        assert not re.search(r"<[^>\s]*>", outside_code), f"{where}: a bare <...> is an HTML tag: {text!r}"
        assert "*" not in outside_code and "_" not in re.sub(r"\w_\w", "", outside_code), (
            f"{where}: * or _ outside backticks can turn into emphasis: {text!r}")
        assert _rendered_text(text) == text.replace("`", ""), f"{where}: renders differently: {text!r}"


def test_the_form_starts_with_the_knobs_most_people_change():
    properties = list(_prefect_form_schema()["definitions"]["RunConfig"]["properties"])
    assert properties[:8] == ["agent", "base_model", "storage", "run", "steps", "group_size", "groups_per_step",
                              "trainer"]
    trainer = list(_prefect_form_schema()["definitions"]["TrainerConfig"]["properties"])
    assert trainer[0] == "learning_rate"
    # the internals come last, each a section of its own
    assert properties[-5:] == ["rollouts", "inference", "training", "retention", "tracking"]
    assert set(properties) == set(RunConfig.model_fields)  # reordered, none renamed


def test_every_auto_on_off_switch_takes_a_bare_on_or_off():
    """YAML and `--set` read a bare on/off as a bool: every auto/on/off field of the run's config maps it back."""
    fields = [f"trainer.{name}" for name, info in RunConfig.model_fields["trainer"].annotation.model_fields.items()
              if "'auto', 'on', 'off'" in str(info.annotation)]
    fields.append("inference.overlap_decode")
    assert len(fields) >= 7, fields  # the trainer's six switches and the server's overlap_decode
    for word in ("on", "off"):
        cfg = load_config("configs/tiny.yaml", [f"{f}={word}" for f in fields])
        for f in fields:
            section, name = f.split(".")
            assert getattr(getattr(cfg, section), name) == word, f
    with pytest.raises(ConfigError, match="trainer.fused_lora: input should be 'auto', 'on' or 'off', got 'maybe'"):
        load_config("configs/tiny.yaml", ["trainer.fused_lora=maybe"])


@pytest.mark.parametrize("field", ["fp8_base", "group_qkv"])
def test_opt_in_switches_are_off_and_set_from_the_command_line(field):
    assert getattr(load_config("configs/tiny.yaml").trainer, field) == "off"
    cfg = load_config("configs/tiny.yaml", [f"trainer.{field}=on"])
    assert getattr(cfg.trainer, field) == "on"
    assert getattr(RunConfig.model_validate(cfg.model_dump(mode="json")).trainer, field) == "on"
    with pytest.raises(ConfigError, match=f"trainer.{field}: input should be 'auto', 'on' or 'off'"):
        load_config("configs/tiny.yaml", [f"trainer.{field}=e4m3"])
