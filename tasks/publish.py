"""Publishing: hot-load the adapter of a step into the inference server and prove it is served.

The mechanics (download with hash check, load, probe) are ``backends.policy_store.publish``. With the
trainer in this process the probe compares the server's logprobs with the trainer's; with training on
a remote GPU worker it checks the new policy answers differently from the previous one. Loading is
idempotent; the policy two steps back is unloaded to bound server memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefect import task

from backends import policy_store

from .retry_policy import TransientError, retry_condition
from .run_config import RunConfig
from .runtime import Runtime, get_runtime

log = logging.getLogger("trajflow")


def local_adapter(rt: Runtime, step: int, expected: dict[str, str] | None):
    return policy_store.local_adapter(rt.store, step, expected, rt.config.project, rt.config.run)


async def _publish(rt: Runtime, step: int, adapter_dir, trainer) -> dict[str, float]:
    cfg = rt.config
    inference = rt.inference_client()
    client = rt.client()
    try:
        metrics = await policy_store.publish(
            inference, client, cfg.policy(step), cfg.policy(step - 1) if step > 0 else None, adapter_dir,
            policy_store.probe_messages(rt.store, step), seed=1234 + step, trainer=trainer,
            tolerance=cfg.inference.probe_tolerance)
    except Exception as exc:
        if "connect" in type(exc).__name__.lower():
            raise TransientError(f"inference server unreachable while publishing {cfg.policy(step)}: {exc}") from exc
        raise
    finally:
        await client.close()
    if step >= 2:
        try:
            await inference.unload_adapter(cfg.policy(step - 2))
        except Exception as exc:  # noqa: BLE001 - an adapter that is already gone is fine
            log.debug("unload of %s skipped: %s", cfg.policy(step - 2), exc)
    return metrics


def publish_policy_fn(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Make `<run>@<step>` servable and verified; returns the served name and probe metrics."""
    rt = get_runtime(config)
    adapter_dir = local_adapter(rt, step, (training or {}).get("adapter"))
    trainer = rt.trainer_at(step) if config.training.mode == "local" else None
    metrics = asyncio.run(_publish(rt, step, adapter_dir, trainer))
    log.info("published %s %s", config.policy(step), metrics)
    return {"policy": config.policy(step), "metrics": metrics}


@task(name="publish", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_condition)
def publish_policy(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Not cached: a restarted server has forgotten its adapters, so publishing must run again."""
    return publish_policy_fn(config, step, training)
