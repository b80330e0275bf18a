"""Trajectory groups as Parquet: one row per trajectory, readable by pandas, polars or duckdb alone.

Columns (a reader needs only pyarrow; the nested ones need no ``json.loads``):

| column | type | meaning |
|---|---|---|
| group_index, trajectory_index | int32 | position of the group in the file, of the trajectory in its group |
| scenario_id | string | the group's scenario |
| policy_step | int32 | the step of the policy that sampled the group, or null (files written before it have no column) |
| reward | float64 | the trajectory's reward |
| error | string | set when the rollout failed |
| metrics | map<string, float64> | the trajectory's metrics, each as a number (a bool as 0/1) |
| metadata | map<string, string> | the trajectory's metadata: strings as they are, other scalars as JSON ("3") |
| messages | list<struct> | the full conversation as plain chat messages, sampled turns included (below) |
| exact_values | string (JSON) | the metrics and metadata values whose Python type the maps above do not keep, or null |
| tools | string (JSON) | tool schemas offered, or null |
| logs | list<string> | free-text notes |
| additional_histories | string (JSON) | side conversations, token ids and logprobs included |
| turn_index | list<int32> | position in ``messages`` of each sampled turn |
| turn_prompt_token_ids, turn_token_ids | list<list<int32>> | per sampled turn: prompt ids, sampled ids |
| turn_logprobs | list<list<float64>> | per sampled turn: sampler logprob of each sampled id (float64: exact) |
| turn_finish_reason, turn_policy | list<string> | per sampled turn |

A message is a struct: ``role``, ``content``, ``tool_call_id``, ``name`` (strings), ``tool_calls``
(``list<struct<id, type, function: struct<name, arguments>>>``), ``keys`` (the message's keys, in their
order) and ``exact``: a JSON object of the values the typed fields cannot hold as they are (keys without
a field, such as ``refusal``; content given as a list of parts; tool calls with other keys or in
another key order than OpenAI's), or null.

Why a hybrid and not every value nested: reading back must give groups equal to the ones written,
field for field and key for key (the JSON of a group is what judge caches and reruns compare), and
the free-form parts cannot be typed per file: metric values are ints, floats or bools, metadata
values any scalar, a message may carry any key and content may be a list of parts, tool schemas
are JSON Schema. So the regular parts (roles, text content, tool calls, numbers, strings) are
typed columns, and what they cannot hold exactly rides in a small JSON column beside them, which a
reader can ignore. Side conversations and tool schemas stay JSON: rare, and as free-form as that.

Group-level data (scenario id, policy step, metadata, metrics, logs, recorded exceptions and the number of
trajectories, so a group with only exceptions survives) is JSON in the file's key-value metadata
under ``trajflow.groups``. Files of the first format (``trajectories-v1``: ``messages``, ``metrics``
and ``metadata`` as JSON strings) are still read, and so are files written before ``policy_step`` existed (no
such column or key: their groups read with ``policy_step`` None).
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup

FORMAT_KEY = b"trajflow.format"
GROUPS_KEY = b"trajflow.groups"
FORMAT = b"trajectories-v2"
FORMAT_V1 = b"trajectories-v1"

_STRING_FIELDS = ("role", "content", "tool_call_id", "name")
_TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
_MESSAGE = pa.struct([
    ("role", pa.string()),
    ("content", pa.string()),
    ("tool_calls", pa.list_(_TOOL_CALL)),
    ("tool_call_id", pa.string()),
    ("name", pa.string()),
    ("keys", pa.list_(pa.string())),
    ("exact", pa.string()),
])
_FUNCTION_KEYS = ("arguments", "name")

_INT_LISTS = pa.list_(pa.list_(pa.int32()))
SCHEMA = pa.schema(
    [
        ("group_index", pa.int32()),
        ("scenario_id", pa.string()),
        ("policy_step", pa.int32()),
        ("trajectory_index", pa.int32()),
        ("reward", pa.float64()),
        ("error", pa.string()),
        ("metrics", pa.map_(pa.string(), pa.float64())),
        ("metadata", pa.map_(pa.string(), pa.string())),
        ("messages", pa.list_(_MESSAGE)),
        ("exact_values", pa.string()),
        ("tools", pa.string()),
        ("logs", pa.list_(pa.string())),
        ("additional_histories", pa.string()),
        ("turn_index", pa.list_(pa.int32())),
        ("turn_prompt_token_ids", _INT_LISTS),
        ("turn_token_ids", _INT_LISTS),
        ("turn_logprobs", pa.list_(pa.list_(pa.float64()))),
        ("turn_finish_reason", pa.list_(pa.string())),
        ("turn_policy", pa.list_(pa.string())),
    ]
)


# ---- messages ------------------------------------------------------------------------------------
def _typed_tool_calls(value: Any) -> list[dict] | None:
    """Tool calls as the typed field holds them (other keys left out), or None when they do not fit it."""
    if not isinstance(value, list):
        return None
    out = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and all(isinstance(call.get(k), str) for k in ("id", "type"))
                and all(isinstance(fn.get(k), str) for k in _FUNCTION_KEYS)):
            return None
        out.append({"id": call["id"], "type": call["type"],
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _tool_calls_back(typed: list[dict]) -> list[dict]:
    """Typed tool calls as dicts in OpenAI's key order (what openai's models dump); other orders ride in `exact`."""
    return [{"id": c["id"], "function": {"arguments": c["function"]["arguments"], "name": c["function"]["name"]},
             "type": c["type"]} for c in typed]


def _message_row(message: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_MESSAGE.names)
    exact: dict[str, Any] = {}
    for key, value in message.items():
        if key in _STRING_FIELDS and (value is None or isinstance(value, str)):
            row[key] = value
        elif key == "tool_calls" and (typed := _typed_tool_calls(value)) is not None:
            row[key] = typed
            if json.dumps(_tool_calls_back(typed)) != json.dumps(value):
                exact[key] = value
        else:
            exact[key] = value
    row["keys"] = list(message)
    row["exact"] = json.dumps(exact) if exact else None
    return row


def _message_back(row: dict[str, Any]) -> dict[str, Any]:
    exact = json.loads(row["exact"]) if row["exact"] else {}
    out = {}
    for key in row["keys"]:
        if key in exact:
            out[key] = exact[key]
        elif key == "tool_calls" and row[key] is not None:
            out[key] = _tool_calls_back(row[key])
        else:
            out[key] = row.get(key)
    return out


# ---- metrics and metadata ------------------------------------------------------------------------
def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        return None


def _scalar_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _maps(metrics: dict[str, Any], metadata: dict[str, Any]) -> tuple[list, list, str | None]:
    """The two map columns and the exact values they cannot hold (see the module docstring)."""
    exact = {
        "metrics": {k: v for k, v in metrics.items() if type(v) is not float},
        "metadata": {k: v for k, v in metadata.items() if not (v is None or isinstance(v, str))},
    }
    exact = {k: v for k, v in exact.items() if v}
    return ([(k, _as_float(v)) for k, v in metrics.items()], [(k, _scalar_text(v)) for k, v in metadata.items()],
            json.dumps(exact) if exact else None)


def _maps_back(row: dict[str, Any]) -> tuple[dict, dict]:
    exact = json.loads(row["exact_values"]) if row["exact_values"] else {}
    metrics, metadata = exact.get("metrics", {}), exact.get("metadata", {})
    return ({k: metrics[k] if k in metrics else v for k, v in row["metrics"]},
            {k: metadata[k] if k in metadata else v for k, v in row["metadata"]})


# ---- rows ----------------------------------------------------------------------------------------
def _split_turns(traj: Trajectory, items: list[Any]) -> tuple[list[dict], list[tuple[int, dict]]]:
    """The plain messages of a trajectory (sampled turns give their message) and its sampled turns."""
    messages, turns = [], []
    for pos, (item, raw) in enumerate(zip(traj.messages_and_choices, items)):
        if isinstance(item, SampledTurn):
            messages.append(raw["message"])
            turns.append((pos, raw))
        else:
            messages.append(raw)
    return messages, turns


def _row(gi: int, ti: int, group: TrajectoryGroup, traj: Trajectory) -> dict[str, Any]:
    data = traj.to_json_dict()
    messages, turns = _split_turns(traj, data["messages_and_choices"])
    metrics, metadata, exact_values = _maps(data["metrics"], data["metadata"])
    return {
        "group_index": gi,
        "scenario_id": group.scenario_id,
        "policy_step": group.policy_step,
        "trajectory_index": ti,
        "reward": traj.reward,
        "error": traj.error,
        "metrics": metrics,
        "metadata": metadata,
        "messages": [_message_row(m) for m in messages],
        "exact_values": exact_values,
        "tools": json.dumps(data["tools"]),
        "logs": list(traj.logs),
        "additional_histories": json.dumps(data["additional_histories"]),
        "turn_index": [pos for pos, _ in turns],
        "turn_prompt_token_ids": [t["prompt_token_ids"] for _, t in turns],
        "turn_token_ids": [t["token_ids"] for _, t in turns],
        "turn_logprobs": [[float(x) for x in t["logprobs"]] for _, t in turns],
        "turn_finish_reason": [t["finish_reason"] for _, t in turns],
        "turn_policy": [t["policy"] for _, t in turns],
    }


def groups_to_parquet(groups: list[TrajectoryGroup]) -> bytes:
    """Serialise groups to Parquet bytes (zstd); see the module docstring for the layout."""
    rows, meta = [], []
    for gi, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"groups[{gi}] is a {type(group).__name__}, expected TrajectoryGroup")
        if group.pending:
            raise ValueError(f"groups[{gi}] has {group.pending} rollouts not awaited yet; await the group first")
        g = group.model_dump(mode="json", exclude={"trajectories"})
        meta.append({**g, "size": len(group.trajectories)})
        rows.extend(_row(gi, ti, group, t) for ti, t in enumerate(group.trajectories))
    columns = {name: [r[name] for r in rows] for name in SCHEMA.names}
    try:
        table = pa.Table.from_pydict(columns, schema=SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise ValueError(f"trajectories do not fit the Parquet layout (token ids must fit int32): {exc}") from None
    table = table.replace_schema_metadata({FORMAT_KEY: FORMAT, GROUPS_KEY: json.dumps(meta).encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _trajectory(row: dict[str, Any], v1: bool) -> Trajectory:
    if v1:
        items: list[Any] = list(json.loads(row["messages"]))
        metrics, metadata = json.loads(row["metrics"]), json.loads(row["metadata"])
    else:
        items = [_message_back(m) for m in row["messages"]]
        metrics, metadata = _maps_back(row)
    for k, pos in enumerate(row["turn_index"]):
        items[pos] = SampledTurn(
            message=items[pos],
            prompt_token_ids=row["turn_prompt_token_ids"][k],
            token_ids=row["turn_token_ids"][k],
            logprobs=row["turn_logprobs"][k],
            finish_reason=row["turn_finish_reason"][k],
            policy=row["turn_policy"][k],
        )
    return Trajectory(
        messages_and_choices=items,
        tools=json.loads(row["tools"]),
        additional_histories=json.loads(row["additional_histories"]),
        reward=row["reward"],
        metrics=metrics,
        metadata=metadata,
        logs=row["logs"],
        error=row["error"],
    )


def groups_from_parquet(data: bytes) -> list[TrajectoryGroup]:
    """Read groups written by :func:`groups_to_parquet` (either format). ValueError on a file of another kind."""
    table = pq.read_table(io.BytesIO(data))
    meta = table.schema.metadata or {}
    if meta.get(FORMAT_KEY) not in (FORMAT, FORMAT_V1) or GROUPS_KEY not in meta:
        raise ValueError(f"not a trajflow trajectories file (missing {FORMAT_KEY.decode()}={FORMAT.decode()} metadata)")
    v1 = meta[FORMAT_KEY] == FORMAT_V1
    groups_meta = json.loads(meta[GROUPS_KEY])
    by_group: dict[int, list[tuple[int, Trajectory]]] = {}
    for row in table.to_pylist():
        by_group.setdefault(row["group_index"], []).append((row["trajectory_index"], _trajectory(row, v1)))
    groups = []
    for gi, g in enumerate(groups_meta):
        size = g.pop("size")
        trajs = [t for _, t in sorted(by_group.get(gi, []), key=lambda x: x[0])]
        if len(trajs) != size:
            raise ValueError(f"group {gi} should hold {size} trajectories, the file has {len(trajs)}")
        groups.append(TrajectoryGroup(trajs, **g))
    return groups
