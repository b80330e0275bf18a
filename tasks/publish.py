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

from backends.policy.publish import ensure_loaded, publish_step
from tasks.run_config import RunConfig
from tasks.support.retry_policy import TransientError, is_transient, retry_condition
from tasks.support.runtime import Runtime, get_runtime

log = logging.getLogger("trajflow")


async def ensure_served(rt: Runtime, step: int) -> None:
    """Load `<run>@<step>` from storage if the server does not list it (a restarted server forgot it)."""
    cfg = rt.config
    name, loaded = await ensure_loaded(rt.store, rt.inference_client(), cfg.project, cfg.run, step)
    if loaded:
        log.info("%s was not served (the inference server restarted?): loaded it from storage", name)


async def _publish(rt: Runtime, step: int, training: dict[str, Any] | None) -> dict[str, float]:
    cfg = rt.config
    # Without a probe record, a trainer in this process (training.mode=local) gives the stronger check.
    in_process = cfg.training.mode == "local" and cfg.training.gpus == 1
    trainer = (lambda: rt.trainer_at(step)) if in_process else None
    client = rt.client()
    try:
        return await publish_step(rt.store, rt.inference_client(), client, cfg.project, cfg.run, step, training,
                                  trainer=trainer, tolerance=cfg.inference.probe_tolerance)
    except Exception as exc:
        if is_transient(exc):
            raise TransientError(f"publishing {cfg.policy(step)}: inference server error worth a retry: {exc}") from exc
        raise
    finally:
        await client.close()


def publish_policy_fn(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Make `<run>@<step>` servable and verified; returns the served name and probe metrics."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    metrics = asyncio.run(_publish(rt, step, training))
    log.info("published %s %s", config.policy(step), metrics)
    return {"policy": config.policy(step), "metrics": metrics}


@task(name="publish", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_condition)
def publish_policy(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    return publish_policy_fn(config, step, training)
