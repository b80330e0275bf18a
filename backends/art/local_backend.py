"""LocalBackend: the embedded inference server and the GRPO trainer in this process, for ART-style scripts.

``await model.register(LocalBackend(storage="runs"))`` opens the run ``<storage>/<project>/<name>``
(the same layout the Prefect flow writes), starts one embedded server per base model, creates the
step-0 adapter if the run is new, and resumes the latest committed step otherwise: the trainer loads
that checkpoint and the server hot-loads its adapter as ``<name>@<step>`` (a bare ``<name>`` then
means that latest step). ``backend.train(model, groups, ...)`` runs one GRPO update and publishes it through
``backends.policy`` (store groups, train, checkpoint, publish with probe: the flow's path) and commits
the step; ``backend.train_sft(model, trajectories, config=...)`` does the same with a supervised step on
demonstrations (backends/policy/sft.py), resumable from its save points like the flow's SFT. Each step trains with the model's trainer settings updated by that call's options only, so a resumed
process trains exactly as the one that stopped. ``_experimental_fork_checkpoint`` copies a step of another run
(storage/fork.py); a registered model that has not trained then loads and serves the forked step at once.

One writer per run: a run has one trainer in this process, and one request writes it at a time (register, train,
log, prune; a second one meanwhile gets RunBusyError, HTTP 409 behind `trajflow backend serve`); registering a
registered model again returns the run as it is. Across processes the run's lease (storage/lease.py), held from
register to close, keeps a flow or another backend off the run. ``run.json`` is written once step 0 exists, so a
registration that fails (a typo in base_model) leaves the run name free, and a refused one changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import weakref
from typing import Any

from agents.group_metrics import merge_step_metrics, summarize
from agents.model import Model, TrainableModel, TrainConfig, TrainResult
from agents.trajectory import TrajectoryGroup
from backends.art.backend_api import BackendAPI, LogResult, split_metrics
from backends.art.errors import NotRegisteredError, RunBusyError
from backends.art.run_line import print_registered
from backends.modeling.devices import resolve_device
from backends.policy.checkpoints import initialize, load_checkpoint, train_step
from backends.policy.publish import publish_step
from backends.policy.sft import sft_metrics, sft_step
from backends.training.sft_config import SFTConfig
from backends.training.sft_data import BadLines, demonstrations_of
from storage.compile_cache import StoreCompileCache
from storage.fork import fork_run
from storage.layout import ADAPTER_DIR, logged_split
from storage.lease import RunLease
from storage.store import RunStore

log = logging.getLogger("trajflow")


class _RunState:
    """One registered trainable model: its store, lease, trainer, and what the request writing it now does."""

    def __init__(self, label: str, store: RunStore, base_model: str):
        self.label, self.store, self.base_model = label, store, base_model
        self.lease: RunLease | None = None
        self.trainer = None
        self.settings = None  # the TrainerConfig the model registered with
        self.ready = False  # registered: step 0 exists and the latest step is served
        self.busy: str | None = None
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def exclusive(self, doing: str):
        """Mark the run as written by this request; RunBusyError while another request writes it."""
        with self._guard:
            if self.busy is not None:
                raise RunBusyError(f"run {self.label} is busy {self.busy}; one request writes a run at a time: "
                                   "retry when that one has returned")
            self.busy = doing
        try:
            yield
        finally:
            with self._guard:
                self.busy = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _check_identity(stored: dict | None, model: TrainableModel, config, storage: str) -> None:
    """Refuse a stored run under another base model or adapter identity (TrainerConfig.IDENTITY_FIELDS)."""
    if not stored:
        return
    where = f"run {model.project}/{model.name} in {storage}"
    if stored.get("base_model") not in (None, model.base_model):
        raise ValueError(f"{where} was trained from {stored.get('base_model')!r}, not {model.base_model!r}; "
                         "use another model name")
    changed = config.identity_changes(stored.get("trainer") or {}, config.model_dump(mode="json"))
    if changed:
        raise ValueError(f"{where} has another adapter ({'; '.join(changed)}); use another model name or the "
                         "original trainer settings")


def step_settings(registered, config: TrainConfig) -> dict:
    """The trainer settings of one step: the registered ones (a TrainerConfig), with this call's options over them."""
    return {k: (v if v is not None else getattr(registered, k)) for k, v in config.model_dump().items()}


def _release_all(runs: dict[str, _RunState]) -> None:
    for state in list(runs.values()):
        state.release()
    runs.clear()


def _shut_down(runs: dict[str, _RunState], servers: dict[str, Any]) -> None:
    """Let the runs go and stop the servers (their HTTP and engine threads). Also at interpreter exit for a script
    that never calls close(): an engine thread still inside a torch call while the interpreter tears down crashes
    the process (SIGSEGV, seen in the README's ART loop run a second time, which has nothing to train)."""
    _release_all(runs)
    for server in list(servers.values()):
        server.stop()
    servers.clear()


class LocalBackend(BackendAPI):
    """Inference and training in this process; checkpoints and trajectories in `storage` (local or s3://)."""

    def __init__(self, storage: str | None = None, device: str = "auto", host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_loras: int = 4, probe_tolerance: float | None = None,
                 track: bool = True):
        super().__init__(track=track)
        self.storage = storage or os.environ.get("TRAJFLOW_STORAGE", "runs")
        self.device = device
        self.host, self.port, self.api_key, self.max_loras = host, port, api_key, max_loras
        self.probe_tolerance = probe_tolerance
        self._servers: dict[str, Any] = {}
        self._servers_lock = threading.Lock()
        self._runs: dict[str, _RunState] = {}
        # a script that never calls close() still lets its runs go and stops its servers when it exits
        weakref.finalize(self, _shut_down, self._runs, self._servers)

    # ---- plumbing --------------------------------------------------------------------------
    def _server(self, base_model: str):
        with self._servers_lock:
            if base_model not in self._servers:
                from backends.serving.app import start_server

                self._servers[base_model] = start_server(model=base_model, host=self.host, port=self.port,
                                                         api_key=self.api_key, device=resolve_device(self.device),
                                                         max_loras=self.max_loras)
            return self._servers[base_model]

    def _state(self, model: Model) -> _RunState:
        state = self._runs.get(f"{model.project}/{model.name}")
        if state is None:
            raise NotRegisteredError(f"model {model.project}/{model.name} is not registered with this backend")
        return state

    def _ready_state(self, model: Model) -> _RunState:
        state = self._state(model)
        if not state.ready:
            raise RunBusyError(f"run {state.label} is busy {state.busy or 'registering'}; retry when it has returned")
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
    async def _register(self, model: Model) -> str | None:
        """Open the run (new: step 0; stored: its latest step) and serve it; the same model again: the run as it is."""
        if not isinstance(model, TrainableModel):
            return None  # a prompted Model keeps its own URL
        from backends.training.config import TrainerConfig

        config = TrainerConfig(**model.trainer)
        key = f"{model.project}/{model.name}"
        state = self._runs.get(key)
        if state is not None:
            await self._register_again(model, state, config)
            return state.store.url
        store = RunStore(self.storage, model.project, model.name)
        stored = store.read_run_config()
        _check_identity(stored, model, config, self.storage)
        state = self._runs[key] = _RunState(key, store, model.base_model)
        state.settings = config
        try:
            with state.exclusive("registering"):
                await self._open(model, state, config, stored)
        except BaseException:
            self._runs.pop(key, None)
            state.release()
            raise
        state.ready = True
        return store.url

    async def _open(self, model: TrainableModel, state: _RunState, config, stored: dict | None) -> None:
        from backends.training.trainer import GRPOTrainer

        server = await asyncio.to_thread(self._server, model.base_model)
        max_rank = server.engine.config.max_lora_rank
        if config.lora_rank > max_rank:
            raise ValueError(f"trainer.lora_rank={config.lora_rank} is larger than the inference server's "
                             f"max_lora_rank {max_rank}: the adapter could be trained but not served")
        store = state.store
        state.lease = await asyncio.to_thread(RunLease(store, "LocalBackend").acquire)
        record = {**(stored or {}), "project": model.project, "run": model.name, "base_model": model.base_model,
                  "storage": self.storage, "trainer": config.model_dump(mode="json")}
        trainer = state.trainer = await asyncio.to_thread(GRPOTrainer, model.base_model, config,
                                                          resolve_device(self.device),
                                                          compile_cache=StoreCompileCache(store))
        latest = store.latest_step()
        if latest is None:
            await asyncio.to_thread(initialize, store, lambda: trainer)
            store.write_run_config(record)  # step 0 exists: the run is this model's now
            metrics = await self._publish(model, state, 0)
            state.lease.check(fresh=True)
            store.commit(0, metrics, extra={"policy": model.get_inference_name(0)})
            latest = 0
        else:
            await asyncio.to_thread(load_checkpoint, store, latest, trainer)
            await self._publish(model, state, latest)
            if record != stored:
                store.write_run_config(record)
        self._serve(model, server)
        print_registered(state.label, store.url, latest)

    async def _register_again(self, model: TrainableModel, state: _RunState, config) -> None:
        """A registered model again: the run as it is; trainer settings that differ from the first registration's
        are applied to the live trainer (those a live trainer cannot change are refused)."""
        if model.base_model != state.base_model:
            raise ValueError(f"model {state.label} is registered with base model {state.base_model!r}, not "
                             f"{model.base_model!r}; use another model name")
        ready = self._ready_state(model)
        if config != ready.settings:
            with ready.exclusive("registering"):
                changes = {k: v for k, v in config.model_dump().items() if getattr(ready.settings, k) != v}
                ready.trainer.update_config(**changes)  # ValueError for the adapter's shape, seed, dtype...
                ready.settings = config
        self._serve(model, self._server(model.base_model))
        print_registered(ready.label, ready.store.url, ready.store.latest_step() or 0)

    def _serve(self, model: TrainableModel, server) -> None:
        model.inference_base_url = server.base_url
        model.inference_api_key = self.api_key

    def run_url(self, model: TrainableModel) -> str:
        """Where the registered model's run is stored: ``<storage>/<project>/<name>``."""
        return self._state(model).store.url

    async def get_step(self, model: TrainableModel) -> int:
        return self._state(model).store.latest_step() or 0

    async def _train(self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig) -> TrainResult:
        state = self._ready_state(model)
        if not groups:
            raise ValueError("train needs at least one trajectory group")
        step = (state.store.latest_step() or 0) + 1
        with state.exclusive(f"training step {step}"):
            state.lease.check()
            state.trainer.update_config(**step_settings(state.settings, config))
            result = await asyncio.to_thread(train_step, state.store, step, state.trainer, groups)
            metrics = merge_step_metrics(summarize(groups, "train"), result["metrics"])
            metrics.update(await self._publish(model, state, step))
            state.lease.check(fresh=True)
            state.store.commit(step, metrics, extra={"policy": model.get_inference_name(step)})
            return TrainResult(step=step, metrics=metrics, checkpoint_path=f"{state.store.step_url(step)}/{ADAPTER_DIR}")

    async def _train_sft(self, model: TrainableModel, conversations: list[Any], config: SFTConfig) -> TrainResult:
        state = self._ready_state(model)
        bad = BadLines(config.on_bad_line)
        demos = demonstrations_of(conversations, bad)
        # the demonstrations' identity, as the flow's file hash: a resumed SFT step refuses other data
        content = json.dumps([[d.messages, d.tools] for d in demos], sort_keys=True, default=str).encode()
        step = (state.store.latest_step() or 0) + 1
        with state.exclusive(f"SFT step {step}"):
            state.lease.check()
            result = await asyncio.to_thread(sft_step, state.store, step, lambda: state.trainer, demos, config,
                                             data_sha256=hashlib.sha256(content).hexdigest(), bad_lines=bad)
            metrics = {**sft_metrics(result), **await self._publish(model, state, step)}
            state.lease.check(fresh=True)
            state.store.commit(step, metrics, extra={"policy": model.get_inference_name(step)})
            return TrainResult(step=step, metrics=metrics, checkpoint_path=f"{state.store.step_url(step)}/{ADAPTER_DIR}")

    async def record_log(self, model: Model, groups: list[TrajectoryGroup], split: str,
                         metrics: dict[str, float] | None = None, step: int | None = None) -> LogResult:
        relpath = logged_split(split)  # refuses a split that is no file name
        state = self._ready_state(model) if isinstance(model, TrainableModel) else None
        if not groups and not metrics:
            raise ValueError("log needs trajectories, trajectory groups or metrics")
        stored = {**(summarize(groups, split) if groups else {}), **split_metrics(split, metrics)}
        if state is None:
            return LogResult(step=step or 0, metrics=stored)
        with state.exclusive(f"logging {split!r}"):
            latest = state.store.latest_step() or 0
            at = latest if step is None else step
            if not state.store.is_committed(at):
                raise ValueError(f"model.log: step {at} of {state.label} is not committed (latest: {latest})")
            if groups:
                await asyncio.to_thread(state.store.write_groups, at, relpath, groups)
            state.store.amend_metrics(at, stored)
        return LogResult(step=at, metrics=stored)

    async def fork_from(self, model: TrainableModel, from_storage: str | None, from_project: str, from_model: str,
                    not_after_step: int | None) -> int:
        from backends.training.config import TrainerConfig

        source = RunStore(from_storage or self.storage, from_project, from_model)
        stored = source.read_run_config()
        if stored is None and source.latest_step() is None:
            raise ValueError(f"_experimental_fork_checkpoint: no run {from_project}/{from_model} in {source.root}")
        _check_identity(stored, model, TrainerConfig(**model.trainer), source.root)
        state = self._runs.get(f"{model.project}/{model.name}")
        if state is None:
            dest = RunStore(self.storage, model.project, model.name)
            lease = await asyncio.to_thread(RunLease(dest, "LocalBackend fork").acquire)
            try:
                return (await asyncio.to_thread(fork_run, source, dest, None, not_after_step)).step
            finally:
                lease.release()
        state = self._ready_state(model)
        with state.exclusive("forking"):
            state.lease.check()
            step = (await asyncio.to_thread(fork_run, source, state.store, None, not_after_step)).step
            await asyncio.to_thread(load_checkpoint, state.store, step, state.trainer)
            await self._publish(model, state, step)  # the forked step is served at once (ART's issue #651)
            return step

    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str = "val/reward") -> list[int]:
        state = self._ready_state(model)
        with state.exclusive("pruning checkpoints"):
            return state.store.apply_retention(1, best_checkpoint_metric, "max")

    def close(self) -> None:
        self.close_trackers()
        with self._servers_lock:
            _shut_down(self._runs, self._servers)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
