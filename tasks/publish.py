"""Publishing: hot-load the adapter of a step into the inference server and prove it is served.

The mechanics (hash-checked download, load, probe, unloading old steps) are
``backends.policy.publish.publish_step``, the path LocalBackend takes too. The probe compares the server's
greedy continuation with the probe record the trainer wrote into ``training.json``, wherever it ran (in
this process or on a GPU worker). Not cached: a restarted server has forgotten its adapters, so
publishing runs again on resume.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefect import task

from backends.policy.publish import KEEP_SERVED, ensure_loaded, publish_step
from tasks.run_config import RunConfig
from tasks.support.retry_policy import TransientError, is_transient, retry_condition
from tasks.support.runtime import Runtime, get_runtime
from tasks.training import training_mode

log = logging.getLogger("trajflow")


async def ensure_served(rt: Runtime, step: int) -> None:
    """Load `<run>@<step>` from storage on every replica that does not list it (a restarted server forgot it)."""
    cfg = rt.config
    for replica, inference in enumerate(rt.inference_clients()):
        name, loaded = await ensure_loaded(rt.store, inference, cfg.project, cfg.run, step)
        if loaded:
            log.info("%s was not served by replica %d (the inference server restarted?): loaded it from storage",
                     name, replica)


async def _publish(rt: Runtime, step: int, training: dict[str, Any] | None) -> dict[str, float]:
    """Publish on every replica, each loaded and probed on its own; the metrics are the worst replica's."""
    cfg = rt.config
    # Without a probe record, a trainer in this process (training.mode local) gives the stronger check.
    in_process = training_mode(cfg) == "local" and cfg.training.gpus == 1
    trainer = (lambda: rt.trainer_at(step)) if in_process else None
    replicas = rt.inference_clients()
    keep = KEEP_SERVED + cfg.pipeline.max_off_policy_steps  # rollouts running ahead still sample k older policies
    merged: dict[str, float] = {}
    for replica, inference in enumerate(replicas):
        client = rt.replica_client(replica)
        try:
            metrics = await publish_step(rt.store, inference, client, cfg.project, cfg.run, step, training,
                                         trainer=trainer, tolerance=cfg.inference.probe_tolerance, keep_served=keep)
        except Exception as exc:
            where = f" on replica {replica}" if len(replicas) > 1 else ""
            if is_transient(exc):
                raise TransientError(f"publishing {cfg.policy(step)}{where}: inference server error worth a retry: "
                                     f"{exc}") from exc
            raise
        finally:
            await client.close()
        for key, value in metrics.items():
            worst = min if key.endswith("common_prefix") else max
            merged[key] = worst(merged[key], value) if key in merged else value
    if len(replicas) > 1:
        merged["publish/replicas"] = float(len(replicas))
    return merged


def publish_policy_fn(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Make `<run>@<step>` servable and verified; returns the served name and probe metrics."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    metrics = asyncio.run(_publish(rt, step, training))
    log.info("published %s %s", config.policy(step), metrics)
    return {"policy": config.policy(step), "metrics": metrics}


@task(name="publish", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_condition)
def publish_policy(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    return publish_policy_fn(config, step, training)
