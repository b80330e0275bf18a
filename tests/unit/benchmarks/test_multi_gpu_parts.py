"""benchmarks/multi_gpu.py's parts merged into one result file, and its budget rule (no GPU, no torch: the merge and
the rule are plain Python; the measurements themselves run under ``--smoke``)."""

from __future__ import annotations

import json

import pytest

from benchmarks import multi_gpu
from benchmarks import multi_gpu_report as report


def _part(name: str, command: str, scale: float) -> dict:
    """A part as multi_gpu.py writes it, its figures scaled by `scale`."""
    details = {
        "train": {"train": {"1": {"tok_s": 100.0 * scale}, "2": {"tok_s": 190.0 * scale}},
                  "train_ddp_max_abs_diff_lora": 1e-3, "lora_compared_after_steps": 3},
        "rollout": {"rollout": {"1": {"tok_s": 50.0 * scale}, "2": {"tok_s": 95.0 * scale}}},
        "step": {"steps": {"shared": {"steps": [{"step_s": 10.0 * scale, "rollouts_s": 6.0 * scale,
                                                  "train_s": 3.0 * scale, "publish_s": 1.0 * scale},
                                                 {"step_s": 12.0 * scale, "rollouts_s": 8.0 * scale,
                                                  "train_s": 3.0 * scale, "publish_s": 1.0 * scale}]},
                           "split": {"steps": [{"step_s": 7.0 * scale}]}}},
    }[name]
    return {"date": "d", "command": command, "environment": {"gpu": f"gpu of {command}"}, "spec": {}, "budget_s": 420.0,
            "wall_s": 1.0, "timed": {}, "details": details}


def test_parts_run_in_two_commands_merge_into_one_summary(tmp_path):
    out = tmp_path / "r.json"
    report.write(out, report.merge(report.load(out, smoke=True), {"train": _part("train", "first", 1)}, True, "t1"))
    first = json.loads(out.read_text())
    assert first["summary"]["train_scaling_2gpu"] == pytest.approx(1.9)
    assert [k for k, v in first["summary"].items() if v is None] == list(report.SUMMARY_KEYS[3:])
    assert first["composed"]["step_wall_s_both_2gpu_composed"] is None  # needs all three parts

    later = {n: _part(n, "second", 1) for n in ("rollout", "step")}
    report.write(out, report.merge(report.load(out, smoke=True), later, True, "t2"))
    doc = json.loads(out.read_text())
    assert tuple(doc["summary"]) == report.SUMMARY_KEYS and None not in doc["summary"].values()
    assert doc["summary"]["rollout_scaling_2replicas"] == pytest.approx(1.9)
    assert doc["summary"]["step_wall_s_shared_1gpu"] == pytest.approx(11.0)
    assert doc["summary"]["step_wall_s_split_2gpu"] == pytest.approx(7.0)
    # shared steps' rollouts / 1.9 + update / 1.9 + publish, averaged
    assert doc["composed"]["step_wall_s_both_2gpu_composed"] == pytest.approx(((6 + 3) / 1.9 + 1 + (8 + 3) / 1.9 + 1) / 2)
    assert {n: p["command"] for n, p in doc["parts"].items()} == {"train": "first", "rollout": "second",
                                                                   "step": "second"}
    assert doc["parts"]["train"]["environment"] == {"gpu": "gpu of first"}
    assert "rollout_tok_s_2replicas | 95" in out.with_suffix(".md").read_text()


def test_a_rerun_replaces_only_its_part(tmp_path):
    out = tmp_path / "r.json"
    report.write(out, report.merge({}, {n: _part(n, "first", 1) for n in report.PARTS}, False, "t1"))
    report.write(out, report.merge(report.load(out, smoke=False), {"rollout": _part("rollout", "again", 2)}, False,
                                   "t2"))
    doc = json.loads(out.read_text())
    assert doc["summary"]["rollout_tok_s_1replica"] == pytest.approx(100.0)
    assert doc["summary"]["train_tok_s_1gpu"] == pytest.approx(100.0)
    assert [p["command"] for p in doc["parts"].values()] == ["first", "again", "first"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(("timed", "deadline", "now", "expected"), [
    ([], 100.0, 500.0, True),        # the first timed step always runs, however late
    ([5.0, 9.0], None, 500.0, True),  # no budget
    ([5.0, 9.0], 100.0, 91.0, True),  # the longest so far (9 s) ends by the deadline
    ([5.0, 9.0], 100.0, 91.5, False),
])
def test_a_timed_step_starts_only_if_it_should_end_within_the_budget(timed, deadline, now, expected):
    assert multi_gpu.may_start(timed, deadline, now) is expected


def test_parts_are_run_in_their_order_once():
    assert multi_gpu.parse_parts("step, train,step") == ("train", "step")


def test_children_keep_the_caller_s_path_and_environment(monkeypatch):
    """On the GPU host pydantic comes from carried wheels on PYTHONPATH, and NCCL's settings from the environment."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    env = multi_gpu._env("1")
    assert env["PYTHONPATH"].split(":") == [str(multi_gpu.REPO), "/tmp/site"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "1"
