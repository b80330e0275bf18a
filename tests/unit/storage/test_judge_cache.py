"""The store-backed judge cache: verdicts as ``judge-cache/<key>.json`` at run level, on a folder and on S3."""

from __future__ import annotations

import json

from agents.judge.cache import JudgeCache
from storage import RunStore
from storage.judge_cache import StoreJudgeCache

KEY = "0123456789abcdef" * 4


def test_verdicts_are_kept_at_run_level_and_read_back_by_another_store(store_root, raw_storage):
    cache = StoreJudgeCache(RunStore(store_root, "proj", "run-1"))
    assert isinstance(cache, JudgeCache)
    assert cache.get(KEY) is None

    verdict = {"scores": {"t0": {"score": 0.75, "explanation": "close"}}}
    cache.put(KEY, verdict)

    assert raw_storage.keys() == [f"proj/run-1/judge-cache/{KEY}.json"]
    assert json.loads(raw_storage.read(f"proj/run-1/judge-cache/{KEY}.json")) == verdict
    assert StoreJudgeCache(RunStore(store_root, "proj", "run-1")).get(KEY) == verdict
    assert StoreJudgeCache(RunStore(store_root, "proj", "run-2")).get(KEY) is None
