"""The judge's cache: a content hash of (judge model, rubric, group) -> the scores it gave.

``cache_key`` is the sha256 of canonical JSON (sorted keys, no whitespace) of the prompt version,
the judge model, the rubric, the task description override, and, per trajectory in order, its
plain messages, tools, error and additional histories (messages + tools). Token ids, logprobs,
rewards and metrics are not part of it: the judge never sees them. The key is therefore the same in
every process and independent of dict ordering and ``PYTHONHASHSEED``.

A cache is anything with ``get(key) -> dict | None`` and ``put(key, value)``; the run's storage
backs it in the flow (``storage.judge_cache.StoreJudgeCache``). Only successful judgments are stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agents.judge.prompt import PROMPT_VERSION, canonical_json
from agents.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[0-9a-f]{64}$")


@runtime_checkable
class JudgeCache(Protocol):
    def get(self, key: str) -> dict | None: ...

    def put(self, key: str, value: dict) -> None: ...


def cache_key(model: str, rubric: str, group: TrajectoryGroup, task_description: str | None = None) -> str:
    """sha256 hex of the canonical JSON of what the judge is shown (see module docstring)."""
    trajectories = [
        {
            "messages": t.messages(),
            "tools": t.tools,
            "error": t.error,
            "additional_histories": [{"messages": h.messages(), "tools": h.tools} for h in t.additional_histories],
        }
        for t in group.trajectories
    ]
    blob = {
        "prompt_version": PROMPT_VERSION,
        "model": model,
        "rubric": rubric,
        "task_description": task_description,
        "trajectories": trajectories,
    }
    return hashlib.sha256(canonical_json(blob).encode("utf-8")).hexdigest()


def check_key(key: str) -> str:
    """Keys are sha256 hex digests; anything else (a path, ``..``) is refused."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"judge cache key must be a 64-char lowercase sha256 hex digest, got {str(key)[:80]!r}")
    return key


class InMemoryJudgeCache:
    """A dict-backed cache for one process (tests, scripts)."""

    def __init__(self) -> None:
        self._data: dict[str, dict] = {}

    def get(self, key: str) -> dict | None:
        value = self._data.get(check_key(key))
        return json.loads(json.dumps(value)) if value is not None else None

    def put(self, key: str, value: dict) -> None:
        self._data[check_key(key)] = json.loads(json.dumps(value))

    def __len__(self) -> int:
        return len(self._data)


class LocalFolderJudgeCache:
    """One JSON file per key under ``root``, written atomically (temp file, then rename)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{check_key(key)}.json"

    def get(self, key: str) -> dict | None:
        path = self.path(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("judge cache entry %s is unreadable (%s); judging again", path.name, exc)
            return None
        return data if isinstance(data, dict) else None

    def put(self, key: str, value: dict) -> None:
        path = self.path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(value, fh, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        return sum(1 for p in self.root.glob("*.json")) if self.root.exists() else 0


def cached_scores(entry: Any, ids: list[str]) -> dict[str, dict[str, Any]] | None:
    """The ``{id: {"score", "explanation"}}`` of a cache entry, or None if it does not fit this group."""
    if not isinstance(entry, dict) or not isinstance(entry.get("scores"), dict):
        return None
    scores = entry["scores"]
    if set(scores) != set(ids):
        return None
    for value in scores.values():
        if not isinstance(value, dict) or isinstance(value.get("score"), bool) \
                or not isinstance(value.get("score"), (int, float)) or not 0.0 <= float(value["score"]) <= 1.0:
            return None
    return scores
