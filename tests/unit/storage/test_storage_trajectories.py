"""Trajectory groups as Parquet: exact round trip through the store, readable without trajflow."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from agents import RecordedException, SampledTurn, Trajectory, TrajectoryGroup
from agents.trajectory import History
from storage import RunStore


def _turn(prompt, ids, logprobs, content=None, tool_call=None, policy="agent@3", finish="stop") -> SampledTurn:
    message = {"role": "assistant", "content": content}
    if tool_call:
        message["tool_calls"] = [
            {"id": "call_0", "type": "function", "function": {"name": tool_call, "arguments": '{"a": 2, "b": 2}'}}
        ]
    return SampledTurn(
        message=message, prompt_token_ids=prompt, token_ids=ids, logprobs=logprobs, finish_reason=finish, policy=policy
    )


def make_groups() -> list[TrajectoryGroup]:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    # logprobs that float32 cannot hold exactly, ids near a large vocabulary's end
    lp = [-0.1234567890123456789, -1e-12, -17.000000000000004]
    t1 = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "2+2? ünïcode ✓"},
            _turn([1, 2, 3], [151_642, 7, 8], lp, tool_call="add", finish="tool_calls"),
            {"role": "tool", "tool_call_id": "call_0", "content": "4"},
            _turn([1, 2, 3, 151_642, 7, 8, 9], [10, 11], [-0.5, -0.25], content="4"),
        ],
        tools=tools,
        reward=0.75,
        metrics={"turns": 2, "ok": True, "score": 0.5},
        metadata={"scenario": "s1", "seed": 3, "none": None, "flag": False},
        logs=["called add", "answered"],
    )
    t1.additional_histories.append(
        History(messages_and_choices=[{"role": "user", "content": "judge"}, _turn([4], [5], [-2.5], content="ok")])
    )
    t2 = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}], reward=-1.0, error="TimeoutError: slow")
    t3 = Trajectory(messages_and_choices=[_turn([], [], [], content="empty", policy=None, finish=None)], reward=0.0)
    only_exceptions = TrajectoryGroup(
        [],
        scenario_id="s2",
        exceptions=[RecordedException(type="ValueError", message="bad tool call", traceback="Traceback ...")],
        metadata={"difficulty": "hard"},
        logs=["group failed"],
    )
    return [
        TrajectoryGroup([t1, t2, t3], scenario_id="s1", metadata={"k": 1}, metrics={"mean": 0.5}, logs=["g"]),
        only_exceptions,
        TrajectoryGroup([t2.model_copy(deep=True)], scenario_id=None),
    ]


def test_exact_round_trip(store_root):
    groups = make_groups()
    store = RunStore(store_root, "proj", "run")
    sha = store.write_groups(1, "trajectories/all.parquet", groups)
    store.commit(1)
    back = RunStore(store_root, "proj", "run").read_groups(1, "trajectories/all.parquet", verify=True)

    assert [g.to_json_dict() for g in back] == [g.to_json_dict() for g in groups]
    assert [g.model_dump_json() for g in back] == [g.model_dump_json() for g in groups]
    turn = back[0].trajectories[0].messages_and_choices[2]
    assert isinstance(turn, SampledTurn)
    assert turn.logprobs == [-0.1234567890123456789, -1e-12, -17.000000000000004]
    assert turn.token_ids == [151_642, 7, 8]
    assert isinstance(back[0].trajectories[0].additional_histories[0].messages_and_choices[1], SampledTurn)
    assert back[1].trajectories == [] and back[1].exceptions[0].message == "bad tool call"
    assert store.read_manifest(1).files["trajectories/all.parquet"].sha256 == sha


def test_empty_list_of_groups(store_root):
    store = RunStore(store_root, "proj", "run")
    store.write_groups(0, "t.parquet", [])
    assert store.read_groups(0, "t.parquet") == []


def test_columns_are_plain_parquet(store_root):
    store = RunStore(store_root, "proj", "run")
    store.write_groups(2, "t.parquet", make_groups())
    table = pq.read_table(io.BytesIO(store.get_bytes(2, "t.parquet")))
    assert table.num_rows == 4  # 3 + 0 + 1 trajectories
    assert table.schema.field("turn_token_ids").type == pa.list_(pa.list_(pa.int32()))
    assert table.schema.field("turn_logprobs").type == pa.list_(pa.list_(pa.float64()))
    row = table.slice(0, 1).to_pylist()[0]
    assert row["turn_index"] == [2, 4]
    assert row["turn_prompt_token_ids"] == [[1, 2, 3], [1, 2, 3, 151_642, 7, 8, 9]]
    assert [m["role"] for m in json.loads(row["messages"])] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(row["messages"])[2]["tool_calls"][0]["function"]["name"] == "add"


def test_readable_by_pandas_without_trajflow(tmp_path):
    """A separate interpreter where importing trajflow's packages fails still reads every column.

    (The bytes are the same on every backend; the S3 round trip is covered above.)
    """
    store = RunStore(str(tmp_path / "store"), "proj", "run")
    store.write_groups(0, "t.parquet", make_groups())
    path = tmp_path / "t.parquet"
    path.write_bytes(store.get_bytes(0, "t.parquet"))
    script = f"""
import sys, json
for name in ("agents", "storage", "backends", "tasks", "flows"):
    sys.modules[name] = None  # any import of trajflow now raises ImportError
import pandas as pd
df = pd.read_parquet({str(path)!r})
first = df.iloc[0]
print(json.dumps({{
    "rows": len(df),
    "rewards": df["reward"].tolist(),
    "scenarios": [None if pd.isna(x) else x for x in df["scenario_id"]],
    "errors": [None if pd.isna(x) else x for x in df["error"]],
    "token_ids": [list(map(int, t)) for t in first["turn_token_ids"]],
    "logprob0": float(first["turn_logprobs"][0][0]),
    "metrics": json.loads(first["metrics"]),
}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {
        "rows": 4,
        "rewards": [0.75, -1.0, 0.0, -1.0],
        "scenarios": ["s1", "s1", "s1", None],
        "errors": [None, "TimeoutError: slow", None, "TimeoutError: slow"],
        "token_ids": [[151_642, 7, 8], [10, 11]],
        "logprob0": -0.1234567890123456789,
        "metrics": {"turns": 2, "ok": True, "score": 0.5},
    }
