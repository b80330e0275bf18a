"""Where Prefect persists task results (and so its cache records): inside the run's own storage.

A cache record lives next to the data it describes, under ``<run>/prefect-results/``, so a new
machine with a fresh Prefect home and the same storage finds every finished stage. Local roots use a
plain path (no block needed); remote roots (s3://…) use a ``RemoteFileSystem`` block saved
idempotently at flow start, with ``settings={}`` so credentials and endpoint come from the
environment and never land in the block document.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from storage.layout import PREFECT_RESULTS_DIR
from tasks.run_config import RunConfig
from tasks.support.runtime import get_runtime


def result_storage_for(config: RunConfig):
    """A value for ``task.with_options(result_storage=...)``: a Path, or a saved ``RemoteFileSystem`` block."""
    # this process's resources for the run (tasks/support/runtime.py)
    url = f"{get_runtime(config).store.url.rstrip('/')}/{PREFECT_RESULTS_DIR}"
    if "://" not in url or url.startswith("file://"):
        path = Path(url.removeprefix("file://"))
        path.mkdir(parents=True, exist_ok=True)
        return path
    from prefect.filesystems import RemoteFileSystem

    name = "trajflow-" + hashlib.sha256(url.encode()).hexdigest()[:16]
    block = RemoteFileSystem(basepath=url, settings={})
    block.save(name, overwrite=True)
    # The saved block itself, not its slug: Prefect loads a slug from the API again for every task call (~0.1 s on
    # a loaded machine, several per step), and builds a new S3 filesystem each time.
    return block
