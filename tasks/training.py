"""Training: one GRPO update of the LoRA adapter, from the checkpoint of step-1 to that of step.

The update reads the scored groups from storage, so it can run here (``training.mode=local``, the
default: in the flow's process on its device) or on a GPU worker (``training.mode=deployment``: the
``train-step`` deployment of ``flows/train_step.py`` on a GPU work pool runs the same function and
writes the same files). Outputs: ``adapter/`` (peft safetensors), ``trainer/`` (optimizer, RNG,
scheduler state) and ``training.json`` (metrics and the adapter's file hashes) in the step folder.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from prefect import task

from .cache_keys import cache_key_fn
from .crash_points import crash_point
from .retry_policy import retry_condition
from .run_config import RunConfig
from .runtime import get_runtime
from .scoring import SCORED

log = logging.getLogger("trajflow")

TRAINING_RESULT = "training.json"


def initialize_policy_fn(config: RunConfig) -> dict[str, Any]:
    """Step 0: the seeded initial adapter (LoRA B = 0, so it equals the base model) and optimizer state."""
    rt = get_runtime(config)
    trainer = rt.fresh_trainer()
    with tempfile.TemporaryDirectory(prefix="trajflow-init-") as tmp:
        trainer.save_checkpoint(tmp)
        hashes = rt.store.upload_folder(0, "adapter", Path(tmp) / "adapter")
        rt.store.upload_folder(0, "trainer", Path(tmp) / "trainer")
    result = {"step": 0, "metrics": {}, "adapter": hashes}
    rt.store.put_json(0, TRAINING_RESULT, result)
    return result


def train_policy_fn(config: RunConfig, step: int) -> dict[str, Any]:
    """Load checkpoint step-1, train on the scored groups of `step`, upload checkpoint `step`."""
    rt = get_runtime(config)
    if rt.store.exists(step, TRAINING_RESULT):  # finished before a kill: never train twice
        return rt.store.get_json(step, TRAINING_RESULT)
    groups = rt.store.read_groups(step, SCORED)
    trainer = rt.trainer_at(step - 1)
    metrics = trainer.train_step(groups)
    crash_point("training", step)
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        trainer.save_checkpoint(tmp)
        hashes = rt.store.upload_folder(step, "adapter", Path(tmp) / "adapter")
        rt.store.upload_folder(step, "trainer", Path(tmp) / "trainer")
    rt.mark_trainer_step(step)
    metrics = {f"train/{k}" if "/" not in k else k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float))}
    result = {"step": step, "metrics": metrics, "adapter": hashes}
    rt.store.put_json(step, TRAINING_RESULT, result)  # written last: marks the update as finished
    log.info("step %d trained: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:8]))
    return result


def train_remote(config: RunConfig, step: int) -> dict[str, Any]:
    """Run the update as the GPU deployment and read its result from storage."""
    from prefect.deployments import run_deployment

    run = run_deployment(config.training.deployment, parameters={"config": config.model_dump(mode="json"),
                                                                 "step": step},
                         timeout=config.training.timeout_s)
    state = getattr(run, "state", None)
    if state is None or not state.is_completed():
        raise RuntimeError(f"training deployment {config.training.deployment!r} for step {step} ended "
                           f"{getattr(state, 'name', 'without a state')}")
    return get_runtime(config).store.get_json(step, TRAINING_RESULT)


@task(name="train", cache_key_fn=cache_key_fn("training"), retries=2, retry_delay_seconds=[10, 60],
      retry_condition_fn=retry_condition, persist_result=True, tags=["trajflow-train"])
def train_policy(config: RunConfig, step: int) -> dict[str, Any]:
    if config.training.mode == "deployment":
        return train_remote(config, step)
    return train_policy_fn(config, step)
