"""Progress of long work, shown in the terminal and as a Prefect progress artifact.

Outside a Prefect run (plain scripts, unit tests) the artifact part is skipped silently; the terminal
line is always printed through the ``trajflow`` logger.
"""

from __future__ import annotations

import logging
import time

from tasks.support.prefect_client import api_client

log = logging.getLogger("trajflow")


def _in_prefect_run() -> bool:
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None
    except Exception:  # noqa: BLE001 - prefect missing or not initialised: no artifacts
        return False


class Progress:
    """Counts finished units of `total`, logging at most every `every_s` seconds and at the end."""

    def __init__(self, label: str, total: int, every_s: float = 2.0):
        self.label, self.total, self.every_s = label, max(total, 1), every_s
        self.done = 0
        self.extra = ""
        self._last = 0.0
        self._started = time.perf_counter()
        self._artifact_id = None
        self._prefect = _in_prefect_run()

    async def start(self) -> Progress:
        if self._prefect:
            try:
                from prefect.artifacts import ProgressArtifact

                async with api_client() as client:
                    artifact = await ProgressArtifact(progress=0.0, description=self.label).acreate(client=client)
                self._artifact_id = artifact.id
            except Exception as exc:  # noqa: BLE001 - progress must never fail the work
                log.debug("progress artifact unavailable: %s", exc)
        return self

    async def advance(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        if extra:
            self.extra = extra
        now = time.perf_counter()
        if now - self._last < self.every_s and self.done < self.total:
            return
        self._last = now
        elapsed = now - self._started
        log.info("%s: %d/%d (%.0f%%) %s [%.1fs]", self.label, self.done, self.total,
                 100.0 * self.done / self.total, self.extra, elapsed)
        if self._artifact_id is not None:
            try:
                from prefect.artifacts import aupdate_progress_artifact

                async with api_client() as client:
                    await aupdate_progress_artifact(self._artifact_id, progress=100.0 * self.done / self.total,
                                                    client=client)
            except Exception as exc:  # noqa: BLE001
                log.debug("progress artifact update failed: %s", exc)
