"""Process-local resources of a run: its store, agent, inference server, policy client and trainer.

Prefect tasks receive only the RunConfig and a step number (small, hashable, cacheable); the heavy
objects live here, created once per process and looked up by ``<project>/<run>``. A fresh process
(after a kill, on another machine) rebuilds them from the config and storage.
"""

from __future__ import annotations

import logging
import os
import threading

from agents.client import policy_client
from backends.modeling.devices import resolve_device
from backends.policy.checkpoints import load_checkpoint
from storage.store import RunStore
from tasks.run_config import RunConfig

log = logging.getLogger("trajflow")


class Runtime:
    """Everything a run needs in this process. Create with :func:`get_runtime`."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.store = RunStore(config.storage, config.project, config.run)
        from agents.registry import get_agent

        self.agent = get_agent(config.agent, **config.agent_options)
        self._server = None
        self._trainer = None
        self._trainer_step: int | None = None
        self._lock = threading.RLock()
        self.api_key = os.environ.get(config.inference.api_key_env) or None
        self.base_url: str | None = None
        self.base_model_name: str | None = None
        self._tracker = None

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
        """Start or attach to the inference server; returns its base URL (…/v1)."""
        with self._lock:
            if self.base_url is not None:
                died = self.server_failure()
                if died is None:
                    return self.base_url
                # A vLLM that died (OOM, a crash, a kill) is started afresh; it has forgotten its adapters, which
                # the rollouts reload from storage (tasks/rollouts.py) and publishing loads anyway.
                log.warning("%s\nrestarting it", died)
                self._server.stop()
                self._server = None
                self.base_url = None
            inf = self.config.inference
            if inf.backend == "url":
                if not inf.url:
                    raise ValueError("inference.backend=url needs inference.url (the server's …/v1 base URL)")
                self.base_url = inf.url.rstrip("/")
            elif inf.backend == "vllm":
                from backends.serving.vllm import VLLMServer
                from tasks.support.vllm_launch import vllm_config

                server = VLLMServer(vllm_config(self.config, self.api_key))
                server.start()
                self._server = server
                self.base_url = server.base_url
            else:
                from backends.serving.app import start_server

                handle = start_server(
                    model=self.config.base_model, host=inf.host, port=inf.port, api_key=self.api_key,
                    device=resolve_device(inf.device), max_loras=inf.max_loras,
                )
                self._server = handle
                self.base_url = handle.base_url
            return self.base_url

    def server_failure(self) -> str | None:
        """Why the vLLM this runtime launched is gone (its exit code and log tail), or None while it runs."""
        failure = getattr(self._server, "failure", None)
        return failure() if failure is not None else None

    def client(self):
        """A fresh policy client (per task: httpx clients must not cross event loops)."""
        return policy_client(self.ensure_server(), api_key=self.api_key, timeout=self.config.rollouts.timeout_s)

    def inference_client(self):
        from backends.serving.inference_client import InferenceClient

        return InferenceClient(self.ensure_server(), api_key=self.api_key)

    # ---- training --------------------------------------------------------------------------
    def trainer_at(self, step: int):
        """The trainer holding exactly the committed checkpoint of `step` (loaded from storage if needed)."""
        from backends.training.trainer import GRPOTrainer

        with self._lock:
            if self._trainer is None:
                self._trainer = GRPOTrainer(self.config.base_model, self.config.trainer,
                                            device=resolve_device(self.config.training.device))
                self._trainer_step = None
            if self._trainer_step != step:
                load_checkpoint(self.store, step, self._trainer)
                self._trainer_step = step
            return self._trainer

    def fresh_trainer(self):
        """A trainer at its seeded initial state (step 0)."""
        from backends.training.trainer import GRPOTrainer

        with self._lock:
            self._trainer = GRPOTrainer(self.config.base_model, self.config.trainer,
                                        device=resolve_device(self.config.training.device))
            self._trainer_step = 0
            return self._trainer

    def mark_trainer_step(self, step: int) -> None:
        with self._lock:
            self._trainer_step = step

    def close(self) -> None:
        with self._lock:
            if self._tracker is not None:
                self._tracker.finish()
                self._tracker = None
            if self._server is not None:
                self._server.stop()
                self._server = None
            self.base_url = None


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

