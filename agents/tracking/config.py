"""What a run reports to experiment trackers: W&B, Trackio, Weave. All off unless named here.

``tracking: {wandb: {project, entity, mode}, trackio: {project}, weave: {project}}`` in a RunConfig or on a
TrainableModel. The config names places only: credentials come from the trackers' own environment variables
(``WANDB_API_KEY``...) and never enter a config, run.json or a log.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# W&B and Trackio project/entity names: one path component, as trajflow's own names
TRACKER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class WandbTracking(BaseModel):
    """One W&B run per trajflow run, resumed (never duplicated) when the run resumes."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(default=None, pattern=TRACKER_NAME,
                                description="W&B project; None: the trajflow project")
    entity: str | None = Field(default=None, pattern=TRACKER_NAME,
                               description="W&B team or user; None: the key's default entity")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="None: WANDB_MODE, else online; offline writes under WANDB_DIR for `wandb sync`")


class TrackioTracking(BaseModel):
    """Trackio: local-first (a SQLite file under TRACKIO_DIR, `trackio show` for the dashboard), no account."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(default=None, pattern=TRACKER_NAME,
                                description="Trackio project; None: the trajflow project")


class WeaveTracking(BaseModel):
    """Weave traces: each rollout and each judge call an op (needs a W&B login: Weave has no offline mode)."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = Field(default=None, pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                description="Weave project (`entity/project` or `project`); None: the trajflow project")


class TrackingConfig(BaseModel):
    """Experiment trackers of a run; each is off unless its section is given."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbTracking | None = Field(default=None, description="Weights & Biases: metrics per step, config, "
                                        "sampled trajectories")
    trackio: TrackioTracking | None = Field(default=None, description="Trackio: the same, local, no account")
    weave: WeaveTracking | None = Field(default=None, description="Weave: rollouts and judge calls as traced ops")
    sample_trajectories: int = Field(default=4, ge=0, le=64,
                                     description="trajectories per step in the tracker's table; more shows more "
                                     "behaviour, costs upload and storage")

    def any_tracker(self) -> bool:
        return self.wandb is not None or self.trackio is not None
