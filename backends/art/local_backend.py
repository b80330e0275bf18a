"""LocalBackend: the embedded inference server and the GRPO trainer in this process, for ART-style scripts.

``await model.register(LocalBackend(storage="runs"))`` opens the run ``<storage>/<project>/<name>``
(the same layout the Prefect flow writes), starts one embedded server per base model, creates the
step-0 adapter if the run is new, and resumes the latest committed step otherwise: the trainer loads
that checkpoint and the server hot-loads its adapter as ``<name>@<step>`` (a bare ``<name>`` then
means that latest step). ``model.train(groups)`` runs one GRPO update and publishes it through
``backends.policy`` (store groups, train, checkpoint, publish with probe: the flow's path) and commits
the step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from agents.group_metrics import merge_step_metrics, summarize
from agents.model import Model, TrainableModel, TrainConfig, TrainResult
from agents.trajectory import TrajectoryGroup
from backends.modeling.devices import resolve_device
from backends.policy.checkpoints import initialize, load_checkpoint, train_step
from backends.policy.publish import publish_step
from storage.layout import logged_split
from storage.store import RunStore

log = logging.getLogger("trajflow")


class _RunState:
    """One registered trainable model: its store, trainer and the step the trainer holds."""

    def __init__(self, store: RunStore, trainer):
        self.store = store
        self.trainer = trainer
        self.lock = asyncio.Lock()


class LocalBackend:
    """Inference and training in this process; checkpoints and trajectories in `storage` (local or s3://)."""

    def __init__(self, storage: str | None = None, device: str = "auto", host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_loras: int = 4, probe_tolerance: float | None = None):
        self.storage = storage or os.environ.get("TRAJFLOW_STORAGE", "runs")
        self.device = device
        self.host, self.port, self.api_key, self.max_loras = host, port, api_key, max_loras
        self.probe_tolerance = probe_tolerance
        self._servers: dict[str, Any] = {}
        self._runs: dict[str, _RunState] = {}

    # ---- plumbing --------------------------------------------------------------------------
    def _server(self, base_model: str):
        if base_model not in self._servers:
            from backends.serving.app import start_server

            self._servers[base_model] = start_server(model=base_model, host=self.host, port=self.port,
                                                     api_key=self.api_key, device=resolve_device(self.device),
                                                     max_loras=self.max_loras)
        return self._servers[base_model]

    def _state(self, model: Model) -> _RunState:
        state = self._runs.get(f"{model.project}/{model.name}")
        if state is None:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend")
        return state

    async def _publish(self, model: TrainableModel, state: _RunState, step: int) -> dict[str, float]:
        from agents.client import policy_client
        from backends.serving.inference_client import InferenceClient

        server = self._server(model.base_model)
        client = policy_client(server.base_url, api_key=self.api_key)
        try:
            return await publish_step(state.store, InferenceClient(server.base_url, api_key=self.api_key), client,
                                      model.project, model.name, step, trainer=lambda: state.trainer,
                                      tolerance=self.probe_tolerance)
        finally:
            await client.close()

    # ---- Backend protocol ------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        if not isinstance(model, TrainableModel):
            return  # a prompted Model keeps its own URL
        from backends.training.config import TrainerConfig
        from backends.training.trainer import GRPOTrainer

        store = RunStore(self.storage, model.project, model.name)
        stored = store.read_run_config()
        if stored and stored.get("base_model") not in (None, model.base_model):
            raise ValueError(f"run {model.project}/{model.name} in {self.storage} was trained from "
                             f"{stored.get('base_model')!r}, not {model.base_model!r}; use another model name")
        config = TrainerConfig(**model.trainer)
        record = {**(stored or {}), "project": model.project, "run": model.name, "base_model": model.base_model,
                  "storage": self.storage, "trainer": config.model_dump(mode="json")}
        store.write_run_config(record)
        server = self._server(model.base_model)
        trainer = await asyncio.to_thread(GRPOTrainer, model.base_model, config, resolve_device(self.device))
        state = self._runs[f"{model.project}/{model.name}"] = _RunState(store, trainer)
        latest = store.latest_step()
        if latest is None:
            await asyncio.to_thread(initialize, store, lambda: trainer)
            latest = 0
            metrics = await self._publish(model, state, 0)
            store.commit(0, metrics, extra={"policy": model.get_inference_name(0)})
        else:
            await asyncio.to_thread(load_checkpoint, store, latest, trainer)
            await self._publish(model, state, latest)
        model.inference_base_url = server.base_url
        model.inference_api_key = self.api_key
        log.info("registered %s/%s at step %d (%s)", model.project, model.name, latest, store.url)

    async def get_step(self, model: TrainableModel) -> int:
        return self._state(model).store.latest_step() or 0

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig) -> TrainResult:
        state = self._state(model)
        async with state.lock:
            step = (state.store.latest_step() or 0) + 1
            overrides = config.model_dump(exclude_none=True)
            if overrides:
                state.trainer.update_config(**overrides)
            result = await asyncio.to_thread(train_step, state.store, step, state.trainer, groups)
            metrics = merge_step_metrics(summarize(groups, "train"), result["metrics"])
            metrics.update(await self._publish(model, state, step))
            state.store.commit(step, metrics, extra={"policy": model.get_inference_name(step)})
            return TrainResult(step=step, metrics=metrics)

    async def log(self, model: Model, groups: list[TrajectoryGroup], split: str) -> dict[str, float]:
        metrics = summarize(groups, split)
        if isinstance(model, TrainableModel):
            state = self._state(model)
            step = state.store.latest_step() or 0
            await asyncio.to_thread(state.store.write_groups, step, logged_split(split), groups)
            state.store.amend_metrics(step, metrics)
        return metrics

    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str = "val/reward") -> list[int]:
        return self._state(model).store.apply_retention(1, best_checkpoint_metric, "max")

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        self._runs.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
