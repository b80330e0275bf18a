"""Process-local resources of a run: its store, agent, inference server, policy client and trainer.

Prefect tasks receive only the RunConfig and a step number (small, hashable, cacheable); the heavy
objects live here, created once per process and looked up by ``<project>/<run>``. A fresh process
(after a kill, on another machine) rebuilds them from the config and storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

from agents.client import policy_client
from backends.modeling.devices import resolve_device
from backends.policy.checkpoints import load_checkpoint
from storage.store import RunStore
from tasks.run_config import RunConfig
from tasks.support.placement import placement, visible_gpus
from tasks.support.shared_loop import on_shared_loop, run_on_shared_loop

log = logging.getLogger("trajflow")


class Runtime:
    """Everything a run needs in this process. Create with :func:`get_runtime`."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.store = RunStore(config.storage, config.project, config.run)
        from agents.registry import get_agent

        self.agent = get_agent(config.agent, **config.agent_options)
        self._servers: list = []
        self._trainer = None
        self._trainer_step: int | None = None
        self._trainer_process = None  # training.mode=process: the child that trains (tasks/support/trainer_process.py)
        self._lock = threading.RLock()
        self.stop_rollouts = threading.Event()  # set: rollouts running ahead of the trainer abandon their groups
        self.api_key = os.environ.get(config.inference.api_key_env) or None
        if self.api_key is None and config.inference.embedded_process and config.inference.backend == "embedded":
            # Another user of this machine could reach a server in its own process on loopback: it gets a key,
            # which only this process and the server's environment hold.
            self.api_key = secrets.token_urlsafe(32)
        self.base_urls: list[str] = []
        self.base_model_name: str | None = None
        self._tracker = None
        self._shared_client: tuple[tuple[str, ...], Any] | None = None  # (server URLs, client) on the shared loop

    # ---- tracking ----------------------------------------------------------------------------
    def tracker(self):
        """The run's experiment trackers (agents/tracking/), opened on first use by the process that trains."""
        with self._lock:
            if self._tracker is None:
                from agents.tracking import RunTracker

                self._tracker = RunTracker(self.config.tracking, project=self.config.project, run=self.config.run,
                                           run_url=self.store.url, run_config=self.config.model_dump(mode="json"))
            return self._tracker

    def traced_rollout(self):
        """The agent's rollout; a Weave op when ``tracking.weave`` is configured."""
        from agents.tracking.weave_ops import init_weave, traced

        weave = self.config.tracking.weave if self.config.tracking else None
        if weave is None:
            return self.agent.rollout
        init_weave(weave.project or self.config.project)
        return traced(self.agent.rollout, "rollout")

    # ---- inference -------------------------------------------------------------------------
    def ensure_server(self) -> str:
        """Start or attach to the inference server(s); returns the first one's base URL (…/v1)."""
        return self.ensure_servers()[0]

    def ensure_servers(self) -> list[str]:
        """Start or attach to the inference servers, one per replica (``inference.replicas``); their base URLs."""
        with self._lock:
            if self.base_urls:
                died = self.server_failure()
                if died is None:
                    return list(self.base_urls)
                # A server process that died (OOM, a crash, a kill) is started afresh; it has forgotten its
                # adapters, which the rollouts reload from storage (tasks/rollouts.py) and publishing loads anyway.
                log.warning("%s\nrestarting the inference servers", died)
                self._stop_servers()
            inf = self.config.inference
            if inf.backend == "url":
                if not inf.url:
                    raise ValueError("inference.backend=url needs inference.url (the server's …/v1 base URL)")
                self.base_urls = [inf.url.rstrip("/")]
                return list(self.base_urls)
            placed = placement(self.config, visible_gpus())["inference"]
            try:
                for i, device in enumerate(placed):
                    server = self._start_server(device, inf.port + i if inf.port else 0, i)
                    self._servers.append(server)
                    self.base_urls.append(server.base_url)
            except BaseException:
                self._stop_servers()
                raise
            if len(placed) > 1:
                log.info("inference: %d replicas on %s: %s", len(placed), ", ".join(placed), ", ".join(self.base_urls))
            return list(self.base_urls)

    def _start_server(self, device: str, port: int, replica: int):
        """Replica `replica`: vLLM or the embedded server as a child process (both `ManagedServer`s, whose
        `failure()` notices their death), or the embedded server on a thread of this process."""
        inf = self.config.inference
        if inf.backend == "vllm":
            from backends.serving.vllm import VLLMServer
            from tasks.support.vllm_launch import vllm_config

            return VLLMServer(vllm_config(self.config, self.api_key, device=device, port=port, replica=replica)).start()
        if inf.embedded_process:
            from tasks.support.embedded_launch import embedded_process

            return embedded_process(self.config, self.api_key, device, port, replica).start()
        from backends.inference.engine_config import EngineConfig
        from backends.serving.app import start_server
        from backends.serving.cli import OVERLAP_CHOICES

        return start_server(model=self.config.base_model, host=inf.host, port=port, api_key=self.api_key,
                            device=device, max_loras=inf.max_loras,
                            config=EngineConfig(overlap_decode=OVERLAP_CHOICES[inf.overlap_decode], **inf.engine))

    @property
    def base_url(self) -> str | None:
        return self.base_urls[0] if self.base_urls else None

    def server_failure(self) -> str | None:
        """Why a server process this runtime launched (vLLM, the embedded one in its own process) is gone (its exit
        code and log tail), or None while they all run."""
        for server in self._servers:
            failure = getattr(server, "failure", None)
            reason = failure() if failure is not None else None
            if reason is not None:
                return reason
        return None

    def client(self):
        """A fresh policy client (its caller closes it; clients must not cross event loops); over several replicas it
        routes each request (agents/replica_router.py)."""
        return policy_client(self.ensure_servers(), api_key=self.api_key, timeout=self.config.rollouts.timeout_s)

    @contextlib.asynccontextmanager
    async def policy_client(self) -> AsyncIterator[Any]:
        """The policy client for the running event loop. On the process's shared loop (tasks/support/shared_loop.py)
        it is the runtime's own, kept open so that the next step reuses its connections, and replaced when the
        servers' URLs change (a restarted server process); on any other loop a fresh one, closed on the way out."""
        if not on_shared_loop():
            client = self.client()
            try:
                yield client
            finally:
                await client.close()
            return
        urls = tuple(await asyncio.to_thread(self.ensure_servers))  # a restart must not stall the shared loop
        if self._shared_client is not None and self._shared_client[0] != urls:
            await self._shared_client[1].close()
            self._shared_client = None
        if self._shared_client is None:
            self._shared_client = (urls, self.client())
        yield self._shared_client[1]

    def replica_client(self, replica: int):
        """A fresh policy client of one replica only (publishing probes each replica itself)."""
        return policy_client(self.ensure_servers()[replica], api_key=self.api_key,
                             timeout=self.config.rollouts.timeout_s)

    def inference_client(self, replica: int = 0):
        from backends.serving.inference_client import InferenceClient

        return InferenceClient(self.ensure_servers()[replica], api_key=self.api_key)

    def inference_clients(self) -> list:
        """One control client (adapter loading, model listing) per replica."""
        return [self.inference_client(i) for i in range(len(self.ensure_servers()))]

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop()
        self._servers = []
        self.base_urls = []

    # ---- training --------------------------------------------------------------------------
    def trainer_at(self, step: int):
        """The trainer holding exactly the committed checkpoint of `step` (loaded from storage if needed)."""
        with self._lock:
            if self._trainer is None:
                self._trainer = self._new_trainer()
                self._trainer_step = None
            if self._trainer_step != step:
                load_checkpoint(self.store, step, self._trainer)
                self._trainer_step = step
            return self._trainer

    def fresh_trainer(self):
        """A trainer at its seeded initial state (step 0)."""
        with self._lock:
            self._trainer = self._new_trainer()
            self._trainer_step = 0
            return self._trainer

    def _new_trainer(self):
        """A trainer on the run's training device, its compiled kernels carried in the run's storage."""
        from backends.training.trainer import GRPOTrainer
        from storage.compile_cache import StoreCompileCache

        return GRPOTrainer(self.config.base_model, self.config.trainer,
                           device=resolve_device(self.config.training.device),
                           compile_cache=StoreCompileCache(self.store))

    def mark_trainer_step(self, step: int) -> None:
        with self._lock:
            self._trainer_step = step

    def trainer_process(self):
        """The run's trainer process (``training.mode=process``), started on its first request."""
        from tasks.support.trainer_process import TrainerProcess

        with self._lock:
            if self._trainer_process is None:
                self._trainer_process = TrainerProcess(self.config)
            return self._trainer_process

    def close(self) -> None:
        with self._lock:
            if self._tracker is not None:
                self._tracker.finish()
                self._tracker = None
            if self._shared_client is not None:
                client, self._shared_client = self._shared_client[1], None
                if on_shared_loop():
                    asyncio.get_running_loop().create_task(client.close())
                else:
                    run_on_shared_loop(client.close())
            self._stop_servers()
            if self._trainer_process is not None:
                self._trainer_process.close()
                self._trainer_process = None


_RUNTIMES: dict[str, Runtime] = {}
_GUARD = threading.Lock()


def get_runtime(config: RunConfig) -> Runtime:
    """The runtime for this config's run in this process (created on first use)."""
    key = f"{config.storage}|{config.project}/{config.run}"
    with _GUARD:
        rt = _RUNTIMES.get(key)
        if rt is None or rt.config != config:
            if rt is not None:
                rt.close()
            rt = _RUNTIMES[key] = Runtime(config)
        return rt


def close_runtime(config: RunConfig) -> None:
    key = f"{config.storage}|{config.project}/{config.run}"
    with _GUARD:
        rt = _RUNTIMES.pop(key, None)
    if rt is not None:
        rt.close()

