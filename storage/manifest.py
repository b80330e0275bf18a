"""The step manifest: the record, written last, that makes a step exist.

It lists every file of the step with its sha256 and size, the step's metrics, free-form ``extra``
(policy name, counts), when and by which trajflow version it was written, and whether retention
pruned it. Parsing validates everything, including that every listed path is a safe relative path
(a forged manifest cannot make a download escape its folder).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from storage.errors import CorruptManifestError
from storage.names import InvalidNameError, safe_relpath


class FileEntry(BaseModel):
    """One file of a committed step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 hex digest of the file's bytes")
    size: int = Field(ge=0, description="size in bytes")


class StepManifest(BaseModel):
    """What a committed step holds. Written atomically, after every file of the step."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    format: Literal[1] = Field(default=1, description="manifest format version")
    step: int = Field(ge=0, le=99_999, description="the step number; equals its folder name")
    created_at: str = Field(description="UTC time of the commit, ISO 8601")
    trajflow_version: str = Field(description="version of trajflow that wrote the manifest")
    files: dict[str, FileEntry] = Field(default_factory=dict, description="relative path inside the step -> hash and size")
    metrics: dict[str, float] = Field(default_factory=dict, description="the step's metrics (loss, reward, ...)")
    extra: dict[str, Any] = Field(default_factory=dict, description="JSON data such as the policy name and counts")
    pruned: bool = Field(default=False, description="retention removed some of the step's files")
    pruned_prefixes: list[str] = Field(default_factory=list, description="the prefixes retention removed")

    @field_validator("files")
    @classmethod
    def _safe_paths(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in files:
            try:
                safe_relpath(rel)
            except InvalidNameError as exc:
                raise ValueError(str(exc)) from None
        return files

    def content_key(self) -> tuple:
        """What makes two commits of a step 'identical': files, metrics and extra (not time nor version)."""
        files = {k: (v.sha256, v.size) for k, v in sorted(self.files.items())}
        metrics = {k: ("nan" if math.isnan(v) else v) for k, v in sorted(self.metrics.items())}
        return files, metrics, json.dumps(self.extra, sort_keys=True)

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


@lru_cache(maxsize=1)
def trajflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trajflow")
    except PackageNotFoundError:
        return "0+unknown"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_manifest(data: bytes, url: str, step: int) -> StepManifest:
    """Parse and validate manifest bytes read from ``url``; raise CorruptManifestError naming the cause."""
    if not data:
        raise CorruptManifestError(f"corrupt manifest {url}: the file is empty")
    try:
        manifest = StepManifest.model_validate_json(data)
    except ValidationError as exc:
        kinds = {e["type"] for e in exc.errors()}
        if kinds & {"json_invalid", "json_type"}:
            cause = f"not valid JSON (truncated or overwritten?): {exc.errors()[0]['msg']}"
        else:
            first = exc.errors()[0]
            cause = f"{exc.error_count()} invalid field(s), first {'.'.join(map(str, first['loc'])) or '<root>'}: {first['msg']}"
        raise CorruptManifestError(f"corrupt manifest {url}: {cause}") from None
    if manifest.step != step:
        raise CorruptManifestError(f"corrupt manifest {url}: it records step {manifest.step}, its folder is step {step}")
    return manifest


def check_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """Metrics must be a dict of names to real numbers (bools and ints become floats)."""
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"metric names must be non-empty strings, got {k!r}")
        if not isinstance(v, (int, float)):
            raise ValueError(f"metric {k!r} must be a number, got {type(v).__name__} {v!r}")
        out[k] = float(v)
    return out


def check_extra(extra: dict | None) -> dict[str, Any]:
    """``extra`` must survive a JSON round trip unchanged."""
    extra = dict(extra or {})
    try:
        back = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"manifest extra must be JSON-serialisable: {exc}") from None
    if back != extra:
        raise ValueError("manifest extra must be plain JSON (string keys, lists not tuples)")
    return extra

