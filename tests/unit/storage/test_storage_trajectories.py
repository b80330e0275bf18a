"""Trajectory groups as Parquet: exact round trip through the store, readable without trajflow."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from agents import RecordedException, SampledTurn, Trajectory, TrajectoryGroup
from agents.trajectory import History
from storage import RunStore
from tests.paths import REPO

DATA = Path(__file__).parent / "data"


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
        metrics={"turns": 2, "ok": True, "score": 0.5, "huge": 2**70, "inf": float("inf")},
        metadata={"scenario": "s1", "seed": 3, "none": None, "flag": False, "ratio": 0.5, "text_3": "3"},
        logs=["called add", "answered"],
    )
    t1.additional_histories.append(
        History(messages_and_choices=[{"role": "user", "content": "judge"}, _turn([4], [5], [-2.5], content="ok")])
    )
    t2 = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}], reward=-1.0, error="TimeoutError: slow")
    t3 = Trajectory(messages_and_choices=[_turn([], [], [], content="empty", policy=None, finish=None)], reward=0.0)
    # what other clients and agents send: content parts, keys without a column, OpenAI's key order for a
    # tool call (what openai's models dump), an odd tool call, a message without content
    openai_call = {"id": "call_1", "function": {"arguments": "{}", "name": "add"}, "type": "function"}
    t4 = Trajectory(
        messages_and_choices=[
            {"content": [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": "x"}}],
             "role": "user"},
            SampledTurn(message={"content": None, "role": "assistant", "tool_calls": [openai_call]},
                        prompt_token_ids=[1], token_ids=[2], logprobs=[-0.5], finish_reason="tool_calls",
                        policy="agent@3"),
            {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": ""},
            {"role": "assistant", "refusal": "no", "reasoning_content": "because", "content": "",
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"},
                             "index": 0}]},
            {"role": "assistant"},
            {"role": "user", "content": "x", "name": None, "keys": ["not", "the", "column"], "exact": 1},
        ],
        reward=0.125,
        metrics={},
        metadata={"empty": "", "neg": -1},
    )
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
        TrajectoryGroup([t2.model_copy(deep=True), t4], scenario_id=None),
    ]


def _same(back: list[TrajectoryGroup], groups: list[TrajectoryGroup]) -> None:
    """Equal field for field, key order and Python types included (the JSON text is the same)."""
    assert [g.model_dump_json() for g in back] == [g.model_dump_json() for g in groups]
    assert [g.to_json_dict() for g in back] == [g.to_json_dict() for g in groups]


def test_exact_round_trip(store_root):
    groups = make_groups()
    store = RunStore(store_root, "proj", "run")
    sha = store.write_groups(1, "trajectories/all.parquet", groups)
    store.commit(1)
    back = RunStore(store_root, "proj", "run").read_groups(1, "trajectories/all.parquet", verify=True)

    _same(back, groups)
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


def test_columns_are_nested_parquet(store_root):
    """Messages, metrics and metadata are read as lists, structs and maps by pyarrow alone (no json.loads)."""
    store = RunStore(store_root, "proj", "run")
    store.write_groups(2, "t.parquet", make_groups())
    table = pq.read_table(io.BytesIO(store.get_bytes(2, "t.parquet")))
    assert table.num_rows == 5  # 3 + 0 + 2 trajectories
    assert table.schema.field("turn_token_ids").type == pa.list_(pa.list_(pa.int32()))
    assert table.schema.field("turn_logprobs").type == pa.list_(pa.list_(pa.float64()))
    assert table.schema.field("metrics").type == pa.map_(pa.string(), pa.float64())
    assert table.schema.field("metadata").type == pa.map_(pa.string(), pa.string())
    assert pa.types.is_list(table.schema.field("messages").type)
    assert pa.types.is_struct(table.schema.field("messages").type.value_type)
    rows = table.to_pylist()
    row = rows[0]
    assert row["turn_index"] == [2, 4]
    assert row["turn_prompt_token_ids"] == [[1, 2, 3], [1, 2, 3, 151_642, 7, 8, 9]]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in row["messages"]] == ["You add numbers.", "2+2? ünïcode ✓", None, "4", "4"]
    assert row["messages"][2]["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]
    assert row["messages"][3]["tool_call_id"] == "call_0"
    assert dict(row["metrics"]) == {"turns": 2.0, "ok": 1.0, "score": 0.5, "huge": 2.0**70, "inf": float("inf")}
    assert dict(row["metadata"]) == {"scenario": "s1", "seed": "3", "none": None, "flag": "false", "ratio": "0.5",
                                     "text_3": "3"}
    # the exact values ride beside: what the maps do not keep (ints, bools, non-string scalars)
    assert json.loads(row["exact_values"]) == {"metrics": {"turns": 2, "ok": True, "huge": 2**70},
                                               "metadata": {"seed": 3, "flag": False, "ratio": 0.5}}
    plain = rows[3]  # {"role": "user", "content": "2+2?"}: nothing beside the typed fields
    assert plain["messages"][0]["exact"] is None and plain["exact_values"] is None
    odd = rows[4]["messages"]
    assert odd[0]["content"] is None and json.loads(odd[0]["exact"])["content"][1]["type"] == "image_url"
    assert odd[1]["tool_calls"][0]["function"]["name"] == "add" and odd[1]["exact"] is None  # OpenAI's order
    assert odd[3]["tool_calls"][0]["function"]["name"] == "f"  # readable, though its exact form rides beside
    assert set(json.loads(odd[3]["exact"])) == {"refusal", "reasoning_content", "tool_calls"}


README_EXAMPLE = re.search(r"```python\n(import pandas as pd\n.*?)```", (REPO / "README.md").read_text(), re.S).group(1)


def test_readable_by_pandas_without_trajflow(tmp_path):
    """A separate interpreter where importing trajflow's packages fails still reads every column, and the
    README's pandas example runs as written. (The bytes are the same on every backend.)"""
    store = RunStore(str(tmp_path), "trajflow", "smollm2-arithmetic")
    store.write_groups(3, "scored.parquet", make_groups())
    path = f"{store.step_url(3)}/scored.parquet"
    script = f"""
import sys, json, contextlib, io
for name in ("agents", "storage", "backends", "tasks", "flows"):
    sys.modules[name] = None  # any import of trajflow now raises ImportError
import os
os.chdir({str(tmp_path.parent)!r})
with contextlib.redirect_stdout(io.StringIO()) as shown:
    exec({README_EXAMPLE.replace("runs/", tmp_path.name + "/")!r})
import pandas as pd
df = pd.read_parquet({path!r})
first = df.iloc[0]
print(json.dumps({{
    "rows": len(df),
    "rewards": df["reward"].tolist(),
    "scenarios": [None if pd.isna(x) else x for x in df["scenario_id"]],
    "errors": [None if pd.isna(x) else x for x in df["error"]],
    "token_ids": [list(map(int, t)) for t in first["turn_token_ids"]],
    "logprob0": float(first["turn_logprobs"][0][0]),
    "metrics": dict(first["metrics"]),
    "last_message": first["messages"][-1]["content"],
    "tool": first["messages"][2]["tool_calls"][0]["function"]["name"],
    "readme_shows": shown.getvalue(),
}}))
"""
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    shown = got.pop("readme_shows")
    assert got == {
        "rows": 5,
        "rewards": [0.75, -1.0, 0.0, -1.0, 0.125],
        "scenarios": ["s1", "s1", "s1", None, None],
        "errors": [None, "TimeoutError: slow", None, "TimeoutError: slow", None],
        "token_ids": [[151_642, 7, 8], [10, 11]],
        "logprob0": -0.1234567890123456789,
        "metrics": {"turns": 2.0, "ok": 1.0, "score": 0.5, "huge": 2.0**70, "inf": float("inf")},
        "last_message": "4",
        "tool": "add",
    }
    assert "0.75" in shown and "'turns': 2.0" in shown


def test_files_of_the_first_format_are_still_read():
    """trajectories-v1 (messages, metrics and metadata as JSON strings), written by the earlier code from the
    groups of make_groups(): the groups come back exactly, so runs stored before still resume."""
    from storage.trajectories import groups_from_parquet

    data = (DATA / "trajectories-v1.parquet").read_bytes()
    assert pq.read_schema(io.BytesIO(data)).field("messages").type == pa.string()
    back = groups_from_parquet(data)
    assert [g.model_dump_json() for g in back] == json.loads((DATA / "trajectories-v1.json").read_text())
    _same(back, make_groups())


async def test_example_agents_real_trajectories_round_trip(store_root, scripted_server, scripted_client):
    """Trajectories the example agents produce through the real client over HTTP (tool calls, tool results,
    malformed calls, a full game) come back exactly."""
    from agents.examples.arithmetic import ArithmeticAgent
    from agents.examples.research import ResearchAgent
    from agents.examples.tictactoe import TicTacToeAgent, cell_name, opponent_move

    def turn(body):
        return sum(1 for m in body["messages"] if m["role"] == "assistant")

    groups = []
    arithmetic = ArithmeticAgent()
    scripted_server.replies = ["<answer>42</answer>", "\x00\ufffd I like turtles <answer>"]
    s = arithmetic.scenarios("val", 0)[0]
    groups.append(TrajectoryGroup([await arithmetic.rollout(scripted_client, "agent@3", s) for _ in range(2)],
                                  scenario_id=s.id))

    research = ResearchAgent()
    s = next(s for s in research.scenarios("val", 0) if s.payload["kind"] == "born_city")
    gold, doc = s.payload["answer"], s.payload["doc_id"]
    scripts = [
        [{"tool_calls": [("search", {"query": gold})]}, {"tool_calls": [("read", {"doc_id": doc})]},
         {"content": "Found it.", "tool_calls": [("answer", {"text": gold, "doc_id": doc})]}],
        [{"tool_calls": [("browse", {"url": "http://x"})]}, {"tool_calls": [("read", '{"doc_id": "doc-')]},
         {"content": '<tool_call>{"name": "read", "arguments": {"doc_id": 12}}</tool_call>'}, "maybe Lisbon?",
         {"tool_calls": [("answer", {"text": gold, "doc_id": doc})]}],
    ]
    trajs = []
    for script in scripts:
        scripted_server.responder = lambda body, script=script: script[turn(body)]
        trajs.append(await research.rollout(scripted_client, "agent@2", s))
    groups.append(TrajectoryGroup(trajs, scenario_id=s.id))

    game = TicTacToeAgent(opponent_skill=1.0)
    s = next(s for s in game.scenarios("val", 0) if s.payload["model_mark"] == "O")

    def play(body):
        rows = re.findall(r"^([123])  ([XO.]) ([XO.]) ([XO.])$", body["messages"][-1]["content"], re.M)
        mark = re.search(r"You are ([XO])", body["messages"][-1]["content"]).group(1)
        board = [c for _, *cells in rows for c in cells]
        return f"<move>{cell_name(opponent_move(board, mark, seed=0, skill=1.0))}</move>"

    scripted_server.responder = play
    groups.append(TrajectoryGroup([await game.rollout(scripted_client, "agent@1", s)], scenario_id=s.id))

    assert sum(len(t.sampled_turns()) for g in groups for t in g.trajectories) >= 12
    assert any(m.get("tool_calls") for g in groups for t in g.trajectories for m in t.messages())
    store = RunStore(store_root, "proj", "run")
    store.write_groups(1, "groups/0000.parquet", groups)
    _same(RunStore(store_root, "proj", "run").read_groups(1, "groups/0000.parquet"), groups)


def test_policy_step_is_a_field_of_the_group_and_a_column_of_its_rows():
    """The step of the sampling policy comes back on the group and is a plain int column per row (null when
    unknown), so `df.policy_step` answers which policy sampled what without parsing names."""
    from storage.trajectories import groups_from_parquet, groups_to_parquet

    groups = make_groups()
    groups[0].policy_step = 3
    data = groups_to_parquet(groups)
    back = groups_from_parquet(data)
    assert [g.policy_step for g in back] == [3] + [None] * (len(groups) - 1)
    _same(back, groups)
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.field("policy_step").type == pa.int32()
    assert table.column("policy_step").to_pylist() == [3 if g is groups[0] else None
                                                       for g in groups for _ in g.trajectories]


def test_files_written_before_the_policy_step_are_still_read():
    """A trajectories-v2 file written by the code before `policy_step` existed (no column, no key; made from
    make_groups() by that code): its groups read back exactly, with policy_step None."""
    from storage.trajectories import groups_from_parquet

    data = (DATA / "trajectories-v2-before-policy-step.parquet").read_bytes()
    assert "policy_step" not in pq.read_schema(io.BytesIO(data)).names
    back = groups_from_parquet(data)
    assert {g.policy_step for g in back} == {None}
    _same(back, make_groups())
