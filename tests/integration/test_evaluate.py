"""The evaluation flow: base model, a trained adapter, and a model behind any URL, on the val split."""

from __future__ import annotations

import json

import pytest

from flows.evaluate import parse_policy
from storage.store import RunStore
from tasks.run_config import load_config


def test_evaluate_policies(prefect_api, tmp_path, tiny_model_path):
    from backends.serving.app import start_server
    from flows.evaluate import evaluate
    from flows.train import train

    config = load_config("configs/tiny.yaml", [f"storage={tmp_path}", "agent=tests.flow_agents:EchoAgent",
                                                "steps=1", "groups_per_step=2", "group_size=2", "eval_scenarios=3"])
    train(config)
    other = start_server(model="tiny-random", port=0, served_name="someone-else")
    try:
        rows = evaluate(config, ["base", "tiny@1", f"url={other.base_url},model=someone-else"])
    finally:
        other.stop()
    assert [r["policy"] for r in rows] == ["base", "tiny@1", "someone-else"]
    assert all(r["val/trajectories"] == 3 for r in rows)
    store = RunStore(config.storage, config.project, config.run)
    stored = [f for f in store.list_files(None, "evaluations/") if f.endswith(".json") and f.count("/") == 1]
    assert len(stored) == 1
    assert json.loads(store.get_bytes(None, stored[0])) == rows
    assert store.get_bytes(None, stored[0].replace(".json", ".png")).startswith(b"\x89PNG")


@pytest.mark.parametrize("spec, match", [("nonsense", "expected base"), ("url=http://x", "model=<name>"),
                                          ("other-run@3", "only adapters of run")])
def test_bad_policy_specs_are_named(spec, match):
    config = load_config("configs/tiny.yaml")
    with pytest.raises(ValueError, match=match):
        parse_policy(spec, config)
    assert parse_policy("@2", config)["label"] == "tiny@2"


def test_the_eval_command_prints_one_row_per_policy(prefect_api, tmp_path, tiny_model_path, capsys):
    from flows.arguments import eval_parser
    from flows.evaluate import run_command

    args = eval_parser().parse_args(["configs/tiny.yaml", "--set", f"storage={tmp_path}", "--set",
                                     "agent=tests.flow_agents:EchoAgent", "--set", "eval_scenarios=2"])
    assert run_command(args) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("[\n"):])  # the flow's own prints, if any, come first
    assert [(r["policy"], r["val/trajectories"]) for r in rows] == [("base", 2)]
