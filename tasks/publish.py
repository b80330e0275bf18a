"""Publishing: hot-load the adapter of a step into the inference server and prove it is served.

The mechanics (download with hash check, load, probe) are ``backends.policy.store.publish``. The probe
compares the server's greedy continuation with the probe record the trainer wrote into ``training.json``,
wherever it ran (in this process or on a GPU worker). A step written before records existed is checked
with the trainer in this process (``training.mode=local``) or, with training on a remote worker, only by
asking that the new policy answer differently from the previous one. Loading is idempotent; the policy
two steps back is unloaded to bound server memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefect import task

from backends.policy import store as policy_store

from tasks.support.retry_policy import TransientError, retry_condition
from tasks.run_config import RunConfig
from tasks.support.runtime import Runtime, get_runtime

log = logging.getLogger("trajflow")


def local_adapter(rt: Runtime, step: int, expected: dict[str, str] | None):
    return policy_store.local_adapter(rt.store, step, expected, rt.config.project, rt.config.run)


# A remote update that moved the trained logprobs by less than this is not required to change answers.
MIN_SHIFT_TO_CHECK = 1e-2


async def _previous_policy(rt: Runtime, inference, step: int, training: dict | None) -> str | None:
    """What the remote-training probe compares against: policy step-1 (loaded if needed), else the base.

    None when no visible change is expected: step 0, or an update whose own measured policy shift
    (``train/probe_shift``) is below MIN_SHIFT_TO_CHECK (e.g. every group had equal rewards).
    """
    shift = ((training or {}).get("metrics") or {}).get("train/probe_shift", 0.0)
    if step == 0 or shift < MIN_SHIFT_TO_CHECK:
        return None
    cfg = rt.config
    served = await inference.models()
    previous = cfg.policy(step - 1)
    if previous in served:
        return previous
    if rt.store.exists(step - 1, "adapter/adapter_model.safetensors"):
        await inference.load_adapter(previous, str(local_adapter(rt, step - 1, None)))
        return previous
    return next(m for m in served if "@" not in m)


async def _publish(rt: Runtime, step: int, adapter_dir, trainer, training: dict | None) -> dict[str, float]:
    cfg = rt.config
    inference = rt.inference_client()
    client = rt.client()
    record = (training or {}).get(policy_store.PROBE_RECORD)
    try:
        weak = trainer is None and record is None
        previous = await _previous_policy(rt, inference, step, training) if weak else None
        messages = policy_store.probe_messages(rt.store, step) if record is None else None  # record: its own ids
        metrics = await policy_store.publish(
            inference, client, cfg.policy(step), previous, adapter_dir, messages, seed=1234 + step,
            trainer=trainer, tolerance=cfg.inference.probe_tolerance, record=record)
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
    old_run = policy_store.PROBE_RECORD not in (training or {})  # written before probe records existed
    trainer = rt.trainer_at(step) if config.training.mode == "local" and old_run else None
    metrics = asyncio.run(_publish(rt, step, adapter_dir, trainer, training))
    log.info("published %s %s", config.policy(step), metrics)
    return {"policy": config.policy(step), "metrics": metrics}


@task(name="publish", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_condition)
def publish_policy(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Not cached: a restarted server has forgotten its adapters, so publishing must run again."""
    return publish_policy_fn(config, step, training)
