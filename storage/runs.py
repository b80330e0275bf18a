"""Listing the runs under a storage root: ``<root>/<project>/<run>`` folders and their committed steps."""

from __future__ import annotations

from pydantic import BaseModel, Field

from storage.errors import StorageError
from storage.fs import Location
from storage.names import InvalidNameError, validate_name
from storage.store import RunStore


class RunInfo(BaseModel):
    """A run found under a storage root."""

    project: str = Field(description="project name")
    run: str = Field(description="run name")
    url: str = Field(description="the run's URL, <root>/<project>/<run>")
    steps: list[int] = Field(default_factory=list, description="committed step numbers, ascending")
    metrics: dict[str, float] = Field(default_factory=dict, description="metrics of the latest committed step")

    @property
    def latest_step(self) -> int | None:
        return self.steps[-1] if self.steps else None


def _valid(kind: str, name: str) -> bool:
    try:
        validate_name(kind, name)
    except InvalidNameError:
        return False
    return True


def list_runs(root: str, storage_options: dict | None = None) -> list[RunInfo]:
    """Every run under ``root`` (folders whose names are not valid project/run names are skipped).

    A local root that does not exist, or a missing bucket, raises StorageError naming it.
    """
    loc = Location(root, storage_options)
    if not loc.root_exists():
        raise StorageError(f"cannot list runs under {loc.url}: it does not exist")
    runs: list[RunInfo] = []
    for project in loc.list_dirs(""):
        if not _valid("project", project):
            continue
        for run in loc.list_dirs(project):
            if not _valid("run", run):
                continue
            store = RunStore(loc.url, project, run, storage_options)
            manifests = store.manifests()
            last = manifests[max(manifests)] if manifests else None
            runs.append(
                RunInfo(project=project, run=run, url=store.url, steps=list(manifests), metrics=last.metrics if last else {})
            )
    return runs
