"""What every ART-style backend does around its own work: ART's call forms, and the run's experiment trackers.

LocalBackend and RemoteBackend implement ``_register``, ``_train``, ``record_log`` and ``fork_from``; this class gives
scripts ART's calls over them:

- ``await backend.train(model, groups, learning_rate=..., loss_fn=...)`` (ART's keywords: train_options.py) and the
  deprecated ``model.train(groups, config=...)`` both end in :meth:`train_with_config`;
- ``await model.log(trajectories_or_groups, split="val", metrics=..., step=...)`` ends in :meth:`log`;
- ``await backend._experimental_fork_checkpoint(model, from_model, ...)`` with ART's signature;
- ``await backend.train_sft(model, trajectories_or_conversations, config=...)``: ART's ``train_sft`` in spirit, a
  supervised step on demonstrations (backends/policy/sft.py), committed as the run's next step.

Tracking happens here, in the script's process: a TrainableModel with ``tracking`` gets one tracker run when it
registers (agents/tracking/), each committed step is logged with a few of its trajectories, each ``model.log`` at
its step. The backend behind ``trajflow backend serve`` is made with ``track=False``: its RemoteBackend clients
track, with their own credentials, so a run is never tracked twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

from agents.model import Model, TrainableModel, TrainConfig, TrainResult, as_groups
from agents.tracking import RunTracker
from agents.trajectory import TrajectoryGroup
from backends.art.train_options import train_config
from backends.training.sft_config import SFTConfig


class LogResult(BaseModel):
    step: int = Field(description="the step the metrics were stored at")
    metrics: dict[str, float] = Field(default_factory=dict, description="the metrics stored, prefixed <split>/")


def split_metrics(split: str, metrics: dict[str, float] | None) -> dict[str, float]:
    """ART's rule for ``model.log(metrics=...)``: a name without a ``/`` goes under ``<split>/``."""
    return {(k if "/" in k else f"{split}/{k}"): float(v) for k, v in (metrics or {}).items()}


class BackendAPI:
    def __init__(self, track: bool = True):
        self.track = track
        self._trackers: dict[str, RunTracker] = {}

    def _tracker(self, model: Model) -> RunTracker | None:
        return self._trackers.get(f"{model.project}/{model.name}")

    # ---- what each backend implements ------------------------------------------------------
    async def _register(self, model: Model) -> str | None:
        """Register; return the run's storage URL (None for a prompted model)."""
        raise NotImplementedError

    async def _train(self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig) -> TrainResult:
        raise NotImplementedError

    async def _train_sft(self, model: TrainableModel, conversations: list[Any], config: SFTConfig) -> TrainResult:
        raise NotImplementedError(f"{type(self).__name__} does not run SFT; use LocalBackend (or `trajflow sft` on "
                                  "the training machine)")

    async def record_log(self, model: Model, groups: list[TrajectoryGroup], split: str,
                         metrics: dict[str, float] | None = None, step: int | None = None) -> LogResult:
        """Store logged trajectories and metrics (untracked); the step they went to and the metrics stored."""
        raise NotImplementedError

    async def fork_from(self, model: TrainableModel, from_storage: str | None, from_project: str, from_model: str,
                    not_after_step: int | None) -> int:
        raise NotImplementedError

    # ---- ART's calls ----------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        run_url = await self._register(model)
        if (self.track and run_url is not None and isinstance(model, TrainableModel) and model.tracking is not None
                and self._tracker(model) is None):
            self._trackers[f"{model.project}/{model.name}"] = RunTracker(
                model.tracking, project=model.project, run=model.name, run_url=run_url,
                run_config=model.model_dump(mode="json", exclude={"inference_api_key"}))

    async def train(self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], *,
                    learning_rate: float | None = None, loss_fn: str | None = None, normalize_advantages: bool = True,
                    scale_rewards: bool | None = None, kl_penalty_coef: float | None = None,
                    epsilon: float | None = None, epsilon_high: float | None = None,
                    truncated_importance_sampling: float | None = None, verbose: bool = False,
                    **art_only: Any) -> TrainResult:
        """One GRPO step on these groups (ART's current call): stores them, trains, checkpoints, commits and serves
        the new step. Keywords as ART's; an unset one keeps the model's trainer setting (train_options.py)."""
        config = train_config(learning_rate=learning_rate, loss_fn=loss_fn, normalize_advantages=normalize_advantages,
                              scale_rewards=scale_rewards, kl_penalty_coef=kl_penalty_coef, epsilon=epsilon,
                              epsilon_high=epsilon_high, truncated_importance_sampling=truncated_importance_sampling,
                              verbose=verbose, **art_only)
        return await self.train_with_config(model, list(trajectory_groups), config)

    async def train_with_config(self, model: TrainableModel, groups: list[TrajectoryGroup],
                                config: TrainConfig) -> TrainResult:
        result = await self._train(model, list(groups), config)
        tracker = self._tracker(model)
        if tracker is not None:
            tracker.log_step(result.step, result.metrics, groups)
        return result

    async def train_sft(self, model: TrainableModel, trajectories: Iterable[Any],
                        config: SFTConfig | dict[str, Any] | None = None, *, verbose: bool = False,
                        **options: Any) -> TrainResult:
        """Supervised fine-tuning of the model's adapter on demonstrations, committed and served as the next step.

        `trajectories`: ART-style Trajectory objects (their messages, sampled turns as assistant messages, and tools)
        or conversation dicts ``{"messages", "tools"?, "metadata"?}``. `config` (an SFTConfig or its dict) and
        `options` (its fields, over `config`'s) set epochs, learning_rate, batch_size...; an unknown one is refused.
        The metrics are ``sft/*`` (backends/training/sft.py) and the publish check's."""
        base = config.model_dump() if isinstance(config, SFTConfig) else dict(config or {})
        settings = SFTConfig.model_validate({**base, **options})
        result = await self._train_sft(model, list(trajectories), settings)
        if verbose:
            print(f"SFT step {result.step}: loss {result.metrics.get('sft/loss', float('nan')):.4f}")
        tracker = self._tracker(model)
        if tracker is not None:
            tracker.log_step(result.step, result.metrics)
        return result

    async def log(self, model: Model, trajectories: Iterable[Any] | None = None, split: str = "val", *,
                  metrics: dict[str, float] | None = None, step: int | None = None) -> dict[str, float]:
        done = await self.record_log(model, as_groups(trajectories), split, metrics, step)
        tracker = self._tracker(model)
        if tracker is not None:
            tracker.log_metrics(done.step, done.metrics)
        return done.metrics

    async def _experimental_fork_checkpoint(self, model: TrainableModel, from_model: str,
                                            from_project: str | None = None, from_s3_bucket: str | None = None,
                                            not_after_step: int | None = None, verbose: bool = False,
                                            prefix: str | None = None, *, from_storage: str | None = None) -> None:
        """Start `model`'s run from `from_model`'s latest checkpointed step (at or before `not_after_step`): ART's
        signature. The source is in this backend's storage, or ``s3://<from_s3_bucket>/<prefix>``, or
        `from_storage` (trajflow's: any storage root). Before ``register`` (ART's order) or after it while the run
        has not trained; a registered model serves the forked step at once."""
        if from_s3_bucket is not None and from_storage is not None:
            raise ValueError("_experimental_fork_checkpoint: give from_s3_bucket or from_storage, not both")
        if from_s3_bucket is not None:
            from_storage = f"s3://{from_s3_bucket}" + (f"/{prefix.strip('/')}" if prefix and prefix.strip("/") else "")
        step = await self.fork_from(model, from_storage, from_project or model.project, from_model, not_after_step)
        if verbose:
            print(f"forked {from_project or model.project}/{from_model}@{step} into {model.project}/{model.name}")

    def close_trackers(self) -> None:
        for tracker in list(self._trackers.values()):
            tracker.finish()
        self._trackers.clear()
