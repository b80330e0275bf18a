"""`trajflow eval` as a user runs it: a successful evaluation logs no `--- Logging error ---` on the way."""

from __future__ import annotations

import json

from flows.cli import build_parser


def test_a_successful_eval_prints_no_logging_error(prefect_api, tmp_path, tiny_model_path, capfd, command_console):
    # the validation score line is logged with step None (an evaluation belongs to no training step)
    args = build_parser().parse_args(["eval", "configs/tiny.yaml", "--set", f"storage={tmp_path}", "--set",
                                      "agent=tests.flow_agents:EchoAgent", "--set", "eval_scenarios=2"])
    assert args.func(args) == 0
    out, err = capfd.readouterr()
    assert "Logging error" not in out + err, err[-3000:]
    assert "step None val: reward" in err  # the line that failed to format
    rows = json.loads(out[out.index("[\n"):])
    assert [row["policy"] for row in rows] == ["base"]
