"""Scenarios: the tasks an agent is asked to solve, with a stable id and a split."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Split = Literal["train", "val", "test"]


class Scenario(BaseModel):
    """One task instance. ``id`` is stable across processes (it keys caches, seeds and storage)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="stable identifier, unique within the agent's scenarios")
    split: Split = Field(default="train", description="train, val or test")
    payload: dict[str, Any] = Field(default_factory=dict, description="whatever the agent needs, JSON-serialisable")

    @field_validator("id")
    @classmethod
    def _id_ok(cls, v: str) -> str:
        if not v or len(v) > 200 or any(c in v for c in "/\\\n\r\t") or v in {".", ".."}:
            raise ValueError(f"scenario id must be 1-200 chars without slashes or control characters: {v!r}")
        return v

    @field_validator("payload")
    @classmethod
    def _payload_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"scenario payload must be JSON-serialisable: {exc}") from exc
        return v

    def digest(self) -> str:
        """Content hash of the scenario (id, split, payload)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
