"""Trajectory groups as Parquet: one row per trajectory, readable by pandas, polars or duckdb alone.

Columns (a reader needs only pyarrow):

| column | type | meaning |
|---|---|---|
| group_index, trajectory_index | int32 | position of the group in the file, of the trajectory in its group |
| scenario_id | string | the group's scenario |
| reward | float64 | the trajectory's reward |
| error | string | set when the rollout failed |
| metrics, metadata | string (JSON) | the trajectory's dicts |
| messages | string (JSON) | the full conversation as plain chat messages, sampled turns included |
| tools | string (JSON) | tool schemas offered, or null |
| logs | list<string> | free-text notes |
| additional_histories | string (JSON) | side conversations, token ids and logprobs included |
| turn_index | list<int32> | position in ``messages`` of each sampled turn |
| turn_prompt_token_ids, turn_token_ids | list<list<int32>> | per sampled turn: prompt ids, sampled ids |
| turn_logprobs | list<list<float64>> | per sampled turn: sampler logprob of each sampled id (float64: exact) |
| turn_finish_reason, turn_policy | list<string> | per sampled turn |

Group-level data (scenario id, metadata, metrics, logs, recorded exceptions and the number of
trajectories, so a group with only exceptions survives) is JSON in the file's key-value metadata
under ``trajflow.groups``. Reading back gives groups equal to the ones written, field for field.
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
FORMAT = b"trajectories-v1"

_INT_LISTS = pa.list_(pa.list_(pa.int32()))
SCHEMA = pa.schema(
    [
        ("group_index", pa.int32()),
        ("scenario_id", pa.string()),
        ("trajectory_index", pa.int32()),
        ("reward", pa.float64()),
        ("error", pa.string()),
        ("metrics", pa.string()),
        ("metadata", pa.string()),
        ("messages", pa.string()),
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


def _row(gi: int, ti: int, group: TrajectoryGroup, traj: Trajectory) -> dict[str, Any]:
    data = traj.to_json_dict()
    items = data["messages_and_choices"]
    messages, turns = [], []
    for pos, (item, raw) in enumerate(zip(traj.messages_and_choices, items)):
        if isinstance(item, SampledTurn):
            messages.append(raw["message"])
            turns.append((pos, raw))
        else:
            messages.append(raw)
    return {
        "group_index": gi,
        "scenario_id": group.scenario_id,
        "trajectory_index": ti,
        "reward": traj.reward,
        "error": traj.error,
        "metrics": json.dumps(data["metrics"]),
        "metadata": json.dumps(data["metadata"]),
        "messages": json.dumps(messages),
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


def _trajectory(row: dict[str, Any]) -> Trajectory:
    items: list[Any] = list(json.loads(row["messages"]))
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
        metrics=json.loads(row["metrics"]),
        metadata=json.loads(row["metadata"]),
        logs=row["logs"],
        error=row["error"],
    )


def groups_from_parquet(data: bytes) -> list[TrajectoryGroup]:
    """Read groups written by :func:`groups_to_parquet`. Raises ValueError on a file of another kind."""
    table = pq.read_table(io.BytesIO(data))
    meta = table.schema.metadata or {}
    if meta.get(FORMAT_KEY) != FORMAT or GROUPS_KEY not in meta:
        raise ValueError(f"not a trajflow trajectories file (missing {FORMAT_KEY.decode()}={FORMAT.decode()} metadata)")
    groups_meta = json.loads(meta[GROUPS_KEY])
    by_group: dict[int, list[tuple[int, Trajectory]]] = {}
    for row in table.to_pylist():
        by_group.setdefault(row["group_index"], []).append((row["trajectory_index"], _trajectory(row)))
    groups = []
    for gi, g in enumerate(groups_meta):
        size = g.pop("size")
        trajs = [t for _, t in sorted(by_group.get(gi, []), key=lambda x: x[0])]
        if len(trajs) != size:
            raise ValueError(f"group {gi} should hold {size} trajectories, the file has {len(trajs)}")
        groups.append(TrajectoryGroup(trajs, **g))
    return groups
