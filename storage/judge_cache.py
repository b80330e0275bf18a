"""The judge cache the flow uses: verdicts kept in the run's own storage, ``judge-cache/<key>.json``.

It fulfils the ``JudgeCache`` contract of :mod:`agents.judge.cache` (``get(key) -> dict | None``,
``put(key, value)``). The cache sits at run level, not in a step, so a verdict is reused by any
step that shows the judge the same group: a resumed step, and a rescoring, cost no judge call.
"""

from __future__ import annotations

from storage.layout import judge_cache_file
from storage.store import RunStore


class StoreJudgeCache:
    """Judge verdicts as JSON files of the run: ``judge-cache/<key>.json`` at run level."""

    def __init__(self, store: RunStore):
        self.store = store

    def get(self, key: str) -> dict | None:
        path = judge_cache_file(key)
        return self.store.get_json(None, path) if self.store.exists(None, path) else None

    def put(self, key: str, value: dict) -> None:
        self.store.put_json(None, judge_cache_file(key), value)
