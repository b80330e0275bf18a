"""Where bytes live: the run layout, step manifests, trajectories as Parquet, folders with hashes, retention.

Light at import: the names below load their modules on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from storage.errors import AlreadyExistsError, CorruptManifestError, HashMismatchError, NotFoundError, StorageError
from storage.names import InvalidNameError, safe_relpath, validate_name

_LAZY = {
    "RunStore": "storage.store",
    "StepManifest": "storage.manifest",
    "FileEntry": "storage.manifest",
    "RunInfo": "storage.runs",
    "list_runs": "storage.runs",
}

__all__ = [
    "AlreadyExistsError",
    "CorruptManifestError",
    "FileEntry",
    "HashMismatchError",
    "InvalidNameError",
    "NotFoundError",
    "RunInfo",
    "RunStore",
    "StepManifest",
    "StorageError",
    "list_runs",
    "safe_relpath",
    "validate_name",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
