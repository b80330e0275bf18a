"""The training flow's experiment tracking: after each commit, the step to the run's trackers (agents/tracking/).

The committed step's metrics, and a few of the trajectories it trained on (read back from ``scored.parquet``, so a
resumed run shows the same ones), go to W&B and/or Trackio at x = step. Nothing happens when ``tracking`` is unset.
"""

from __future__ import annotations

from storage.layout import SCORED
from tasks.run_config import RunConfig
from tasks.support.runtime import get_runtime


def track_step(config: RunConfig, step: int, metrics: dict[str, float]) -> None:
    if config.tracking is None or not config.tracking.any_tracker():
        return
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    groups = None
    if config.tracking.sample_trajectories and rt.store.exists(step, SCORED):
        groups = rt.store.read_groups(step, SCORED)
    rt.tracker().log_step(step, metrics, groups)
