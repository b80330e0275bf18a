"""RunTracker: what one trajflow run reports to the trackers its TrackingConfig names.

Per committed step: its metrics at x = step, and a table of a few of its trajectories (agents/tracking/samples.py);
per ``model.log``: that split's metrics at its step. The run's config (no credentials: configs name places, keys stay
in the environment) is the tracker run's config. Opening a tracker that is configured but cannot start (W&B online
without a login, the package not installed) raises at once, naming the tracker; a failure while logging a step is
logged and the run goes on: a tracker's hiccup never costs a training step.
"""

from __future__ import annotations

import logging
from typing import Any

from agents.tracking.config import TrackingConfig
from agents.trajectory import TrajectoryGroup

log = logging.getLogger("trajflow")


class TrackingError(RuntimeError):
    """A configured tracker could not start; the message names it and why."""


class RunTracker:
    def __init__(self, config: TrackingConfig | None, *, project: str, run: str, run_url: str,
                 run_config: dict[str, Any] | None = None):
        self.config = config or TrackingConfig()
        self.sinks: list[Any] = []
        where = {"project": project, "run": run, "run_url": run_url, "config": run_config or {}}
        opened = []
        try:
            if self.config.wandb is not None:
                opened.append("wandb")
                from agents.tracking.wandb_run import WandbRun

                self.sinks.append(WandbRun(self.config.wandb, **where))
            if self.config.trackio is not None:
                opened.append("trackio")
                from agents.tracking.trackio_run import TrackioRun

                self.sinks.append(TrackioRun(self.config.trackio, **where))
        except Exception as exc:  # noqa: BLE001 - any tracker's own error, reported as one line
            self.finish()
            hint = " (pip install 'trajflow[tracking]')" if isinstance(exc, ImportError) else ""
            raise TrackingError(f"tracking: cannot start {opened[-1]} for run {project}/{run}: "
                                f"{type(exc).__name__}: {exc}{hint}") from None
        if self.config.weave is not None:
            from agents.tracking.weave_ops import init_weave

            init_weave(self.config.weave.project or project)

    @property
    def active(self) -> bool:
        return bool(self.sinks)

    def log_step(self, step: int, metrics: dict[str, float], groups: list[TrajectoryGroup] | None = None) -> None:
        """A committed step: its metrics and a table of `sample_trajectories` of its trajectories."""
        if not self.sinks:
            return
        table = None
        if groups and self.config.sample_trajectories:
            from agents.tracking.samples import COLUMNS, sample_rows

            table = (COLUMNS, sample_rows(step, groups, self.config.sample_trajectories))
        self._each(step, dict(metrics), table)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.sinks and metrics:
            self._each(step, dict(metrics), None)

    def _each(self, step: int, metrics: dict[str, float], table) -> None:
        for sink in self.sinks:
            try:
                sink.log(step, metrics, table)
            except Exception as exc:  # noqa: BLE001 - see module docstring
                log.warning("tracking: %s could not log step %d: %s: %s", type(sink).__name__, step,
                            type(exc).__name__, exc)

    def finish(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.finish()
            except Exception as exc:  # noqa: BLE001
                log.warning("tracking: %s did not finish cleanly: %s", type(sink).__name__, exc)
