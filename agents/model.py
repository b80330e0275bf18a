"""ART's script API: `Model`, `TrainableModel`, `TrainConfig`, `TrainResult`; training goes through a backend.

``TrainableModel(name, project, base_model)`` + ``await model.register(backend)`` + ``model.openai_client()`` +
``result = await backend.train(model, groups, learning_rate=...)`` + ``await model.log(val, split="val")`` is
ART's loop today; the older ``await model.train(groups, config=TrainConfig(...))`` still works and warns. The model
holds no weights and imports no torch: the backend (``LocalBackend`` in this process, ``RemoteBackend`` over HTTP)
owns the server and the trainer, and stores steps in the same layout as the Prefect flow, so a run can move between
a script and ``flows/train.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Literal, Protocol

from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from agents.tracking.config import TrackingConfig
from agents.trajectory import RecordedException, Trajectory, TrajectoryGroup


def policy_name(run: str, step: int) -> str:
    """The served name of a run's policy after `step` updates: ``<run>@<step>`` (a bare ``<run>`` is the latest)."""
    return f"{run}@{step}"


class TrainConfig(BaseModel):
    """Per-step training options (ART's older ``TrainConfig``, and what ``backend.train``'s keywords become); an
    unset field takes the model's trainer setting (``TrainableModel.trainer``), for this step only."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(default=None, gt=0, description="learning rate of this step's update")
    loss: Literal["cispo", "ppo", "gspo"] | None = Field(default=None, description="policy loss for this step")
    scale_rewards: bool | None = Field(default=None, description="divide advantages by the group reward std")
    kl_coef: float | None = Field(default=None, ge=0, description="KL-shaped advantages against the base model")
    epsilon: float | None = Field(default=None, ge=0, description="lower clip bound of the importance ratio")
    epsilon_high: float | None = Field(default=None, ge=0, description="upper clip bound of the importance ratio")
    tis_cap: float | None = Field(default=None, gt=0, description="truncated importance sampling cap")


class TrainResult(BaseModel):
    """What ``backend.train`` returns: ART's ``TrainResult`` (step, metrics) and LocalTrainResult's checkpoint_path."""

    step: int = Field(description="the step committed by this update")
    metrics: dict[str, float] = Field(default_factory=dict, description="trainer and reward metrics of the step")
    checkpoint_path: str | None = Field(default=None, description="where the step's adapter is stored")


class Backend(Protocol):
    """What a model needs from a backend; LocalBackend and RemoteBackend implement it (backends/art/backend_api.py)."""

    async def register(self, model: Model) -> None: ...
    async def get_step(self, model: TrainableModel) -> int: ...
    async def train_with_config(self, model: TrainableModel, groups: list[TrajectoryGroup],
                                config: TrainConfig) -> TrainResult: ...
    async def log(self, model: Model, groups: list[TrajectoryGroup], split: str = "val", *,
                  metrics: dict[str, float] | None = None, step: int | None = None) -> dict[str, float]: ...
    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str) -> list[int]: ...


def as_groups(trajectories: Iterable[Any] | None) -> list[TrajectoryGroup]:
    """What ``model.log`` accepts, as groups: groups as they are; a flat list of trajectories (exceptions among them
    recorded as failures) as one group; None as none."""
    items = list(trajectories or [])
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    if any(isinstance(i, TrajectoryGroup) for i in items):
        raise TypeError("model.log takes trajectory groups or trajectories, not a mix of both")
    bad = [type(i).__name__ for i in items if not isinstance(i, (Trajectory, BaseException))]
    if bad:
        raise TypeError(f"model.log takes trajectories or trajectory groups, got {bad[0]}")
    return [TrajectoryGroup([i for i in items if isinstance(i, Trajectory)],
                            exceptions=[RecordedException.from_exception(i) for i in items
                                        if isinstance(i, BaseException)])]


class Model(BaseModel):
    """A prompted (non-trainable) model behind an OpenAI-compatible URL: baselines and judges."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="model name; for a TrainableModel also the run name and served policy name")
    project: str = Field(default="trajflow", description="project the run belongs to in storage")
    inference_base_url: str | None = Field(default=None, description="OpenAI-compatible base URL (…/v1)")
    inference_api_key: str | None = Field(default=None, repr=False, exclude=True,
                                          description="API key for the endpoint (never stored)")
    inference_model_name: str | None = Field(default=None, description="model id to send; defaults to name")
    config: dict[str, Any] = Field(default_factory=dict, description="free-form settings recorded with the run")

    _backend: Backend | None = PrivateAttr(default=None)
    _client: AsyncOpenAI | None = PrivateAttr(default=None)

    async def register(self, backend: Backend) -> None:
        """Attach to a backend (it fills in the inference URL and key)."""
        self._backend = backend
        self._client = None
        await backend.register(self)

    def openai_client(self) -> AsyncOpenAI:
        """An AsyncOpenAI for this model's endpoint; requests always carry token ids and logprobs."""
        if self.inference_base_url is None:
            raise RuntimeError(f"model {self.name!r} has no inference URL: register it with a backend first, "
                               "or set inference_base_url")
        if self._client is None:
            from agents.client import policy_client

            self._client = policy_client(self.inference_base_url, api_key=self.inference_api_key)
        return self._client

    def get_inference_name(self, step: int | None = None) -> str:
        """The model id to request: the latest policy, or a pinned ``<name>@<step>``."""
        if step is not None:
            return policy_name(self.name, step)
        return self.inference_model_name or self.name

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"model {self.name!r} is not registered: call `await model.register(backend)` first")
        return self._backend

    async def log(self, trajectories: Iterable[Trajectory | BaseException] | Iterable[TrajectoryGroup] | None = None,
                  split: str = "val", *, metrics: dict[str, float] | None = None,
                  step: int | None = None) -> dict[str, float]:
        """Store trajectories (groups, or a flat list) and/or metrics under `split` at `step` (default: the latest
        step), as ART's ``model.log``; returns the metrics stored, prefixed ``<split>/``."""
        groups = as_groups(trajectories)
        if not groups and not metrics:
            raise ValueError("model.log needs trajectories, trajectory groups or metrics")
        return await self._require_backend().log(self, groups, split, metrics=metrics, step=step)


class TrainableModel(Model):
    """A model trained with GRPO: base weights + a LoRA adapter per step."""

    base_model: str = Field(description="smollm2-135m, tiny-random or a local HF folder")
    trainer: dict[str, Any] = Field(default_factory=dict,
                                    description="trainer settings (backends.training.config.TrainerConfig fields)")
    tracking: TrackingConfig | None = Field(default=None, description="experiment trackers (W&B, Trackio, Weave)")

    async def get_step(self) -> int:
        """The last committed step (0 before any training)."""
        return await self._require_backend().get_step(self)

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | None = None) -> TrainResult:
        """ART's older form of ``await backend.train(model, groups, learning_rate=...)``: the same step (stores the
        groups, trains, checkpoints, commits, serves the new step); deprecated as in ART."""
        warnings.warn("model.train(groups, config=TrainConfig(...)) is deprecated, as in ART: use "
                      "`await backend.train(model, groups, learning_rate=...)`", DeprecationWarning, stacklevel=2)
        return await self._require_backend().train_with_config(self, list(groups), config or TrainConfig())

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Prune adapters except the newest step and the best by `best_checkpoint_metric`."""
        return await self._require_backend().delete_checkpoints(self, best_checkpoint_metric)
