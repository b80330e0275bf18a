"""Reading a judge's answer: find the JSON, match scores by id, validate and clamp.

Where the JSON is: the whole reply; else each fenced code block; else the first ``{`` (or ``[``)
from which a JSON value decodes, skipping prose before and after. ``<think>...</think>`` blocks are
dropped first. The value is ``{"scores": [{"id", "score", "explanation"?}]}`` (a bare list of
entries is accepted too).

Matching is by id only: every expected id exactly once, no unknown id. An id written as a bare
number ``2`` or ``"2"`` means ``t2``. A score must be a finite number (a numeric string is accepted)
and is clamped to [0, 1]. Anything else raises :class:`JudgeParseError` naming every problem found,
so the retry log says what the judge got wrong.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel, Field


class JudgeParseError(ValueError):
    """The judge's reply could not be turned into one valid score per trajectory."""


class JudgedScore(BaseModel):
    """The judge's verdict on one trajectory."""

    id: str = Field(description="trajectory id as sent, t1..tN")
    score: float = Field(description="score clamped to [0, 1]")
    raw_score: float = Field(description="the number the judge wrote, before clamping")
    explanation: str = Field(default="", description="the judge's reason, if given")


_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def extract_json(text: str) -> Any:
    """The first JSON object (or list) in ``text``, tolerating code fences and surrounding prose."""
    if text is None or not str(text).strip():
        raise JudgeParseError("the judge's reply is empty")
    text = _THINK.sub("", str(text)).strip()
    candidates = [text] + [m.group(1).strip() for m in _FENCE.finditer(text)]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, (dict, list)):
            return value
    decoder = json.JSONDecoder()
    fallback = None
    for match in re.finditer(r"[{\[]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except ValueError:
            continue
        if isinstance(value, dict) and "scores" in value:
            return value
        if isinstance(value, dict) or (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            fallback = value if fallback is None else fallback
    if fallback is not None:
        return fallback
    raise JudgeParseError(f"no JSON object found in the judge's reply: {text[:200]!r}")


def _normalize_id(raw: Any) -> str | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return f"t{raw}"
    if isinstance(raw, str):
        s = raw.strip().strip('"').lower()
        if s.isdigit():
            return f"t{int(s)}"
        if s.startswith("t") and s[1:].isdigit():
            return f"t{int(s[1:])}"
        return s or None
    return None


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            return None
    else:
        return None
    return value if math.isfinite(value) else None


def parse_scores(text: str, ids: list[str]) -> dict[str, JudgedScore]:
    """Scores by id from the judge's reply; raises :class:`JudgeParseError` on any mismatch."""
    data = extract_json(text)
    entries = data.get("scores") if isinstance(data, dict) else data
    if entries is None and isinstance(data, dict):
        raise JudgeParseError(f"the judge's JSON has no 'scores' list (keys: {sorted(data)[:10]})")
    if not isinstance(entries, list):
        raise JudgeParseError(f"'scores' must be a list, got {type(entries).__name__}")

    problems: list[str] = []
    found: dict[str, JudgedScore] = {}
    duplicated: list[str] = []
    unknown: list[str] = []
    expected = set(ids)
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"entry {k} is not an object: {str(entry)[:60]!r}")
            continue
        tid = _normalize_id(entry.get("id", entry.get("trajectory_id")))
        if tid is None:
            problems.append(f"entry {k} has no usable id: {str(entry.get('id'))[:40]!r}")
            continue
        if tid not in expected:
            unknown.append(tid)
            continue
        if tid in found:
            duplicated.append(tid)
            continue
        raw = _number(entry.get("score"))
        if raw is None:
            problems.append(f"score of {tid} is not a finite number: {str(entry.get('score'))[:40]!r}")
            continue
        explanation = entry.get("explanation", entry.get("reason", ""))
        found[tid] = JudgedScore(
            id=tid, score=min(1.0, max(0.0, raw)), raw_score=raw,
            explanation=explanation if isinstance(explanation, str) else json.dumps(explanation),
        )
    missing = [i for i in ids if i not in found and not any(p.startswith(f"score of {i} ") for p in problems)]
    if len(entries) != len(ids):
        problems.insert(0, f"expected {len(ids)} scores, got {len(entries)}")
    if missing:
        problems.append(f"missing ids {missing}")
    if duplicated:
        problems.append(f"duplicated ids {sorted(set(duplicated))}")
    if unknown:
        problems.append(f"unknown ids {sorted(set(unknown))}")
    if problems:
        raise JudgeParseError("; ".join(problems))
    return found
