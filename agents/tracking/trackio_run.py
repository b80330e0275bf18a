"""The Trackio side of a run: Trackio's run ``<run name>`` in the project, resumed when the run resumes.

Trackio keeps one current run per process (``trackio.init`` finishes the previous one), so two trajflow runs tracked
by one process alternate; metrics are logged at ``step`` (the trajflow step). Its data is a SQLite file under
``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``); ``trackio show`` opens the dashboard.
"""

from __future__ import annotations

from typing import Any

from agents.tracking.config import TrackioTracking


class TrackioRun:
    def __init__(self, cfg: TrackioTracking, *, project: str, run: str, run_url: str, config: dict[str, Any]):
        import trackio

        self._trackio = trackio
        self.run = trackio.init(project=cfg.project or project, name=run, config=config, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, float], table: tuple[list[str], list[list[Any]]] | None) -> None:
        data: dict[str, Any] = dict(metrics)
        if table is not None:
            data["trajectories"] = self._trackio.Table(columns=table[0], data=table[1])
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()
