"""The W&B side of a run: one W&B run per trajflow run, found again by its id when the run resumes.

Rule: the W&B run id is ``sha256(<the run's storage URL>)[:16]`` and ``wandb.init`` gets ``resume="allow"``, so every
process that continues the run (a resumed script, a restarted flow, another machine on the same storage) logs into
the same W&B run; ART opens a new one per call on its serverless backend (its issue #638). The x axis of every metric
is ``step`` (the trajflow step), declared with ``define_metric``, so metrics logged later for an earlier step
(``model.log(..., step=3)``) land at 3. The console is not captured: trajflow's log lines stay out of W&B.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from agents.tracking.config import WandbTracking

STEP_METRIC = "step"


def wandb_run_id(run_url: str) -> str:
    return hashlib.sha256(run_url.encode()).hexdigest()[:16]


class WandbRun:
    def __init__(self, cfg: WandbTracking, *, project: str, run: str, run_url: str, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        kwargs: dict[str, Any] = {"mode": cfg.mode} if cfg.mode else {}
        # W&B reads WANDB_DIR once per process (its first init); a run opened later goes where the variable says now
        if os.environ.get("WANDB_DIR"):
            kwargs["dir"] = os.environ["WANDB_DIR"]
        self.run = wandb.init(project=cfg.project or project, entity=cfg.entity, id=wandb_run_id(run_url), name=run,
                              resume="allow", config=config, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True), **kwargs)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log(self, step: int, metrics: dict[str, float], table: tuple[list[str], list[list[Any]]] | None) -> None:
        data: dict[str, Any] = {**metrics, STEP_METRIC: step}
        if table is not None:
            data["trajectories"] = self._wandb.Table(columns=table[0], data=table[1])
        self.run.log(data)

    def finish(self) -> None:
        self.run.finish()
