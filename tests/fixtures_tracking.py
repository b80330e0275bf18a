"""Reading back what the experiment trackers stored on this machine: W&B's offline runs and Trackio's database.

W&B (0.31, its core in Go) writes an offline run as ``<WANDB_DIR>/wandb/offline-run-<time>-<id>/run-<id>.wandb``: a
7-byte header (``:W&B``, a magic number, a version), then LevelDB-log records (32 KiB blocks; each record a crc32, a
length, a type: full, first, middle, last) holding protobuf ``Record`` messages. :func:`wandb_offline_runs` reads them
with W&B's own protobuf classes; it is what ``wandb sync`` uploads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024


@dataclass
class OfflineRun:
    folder: Path
    run_id: str = ""
    name: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_runs(wandb_dir: str | Path) -> list[OfflineRun]:
    """Every offline run under `wandb_dir`, oldest first, with its id, config and history rows (values decoded)."""
    runs = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        run = OfflineRun(folder=path.parent)
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.run_id, run.name, run.project = record.run.run_id, record.run.display_name, record.run.project
                run.config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                run.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                run.history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in record.history.item})
        runs.append(run)
    return runs


def trackio_logs(project: str, run: str) -> list[dict[str, Any]]:
    """Trackio's rows of `run` (TRACKIO_DIR as the process had it when trackio was imported)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def trackio_runs(project: str) -> list[str]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_runs(project)
