"""The GPU-side training step, deployed on a GPU work pool (see prefect.yaml, deployment `train-step/gpu`).

The driver flow (`flows/train.py` with ``training.mode=deployment``) calls it through
``run_deployment``; it reads the scored groups and the previous checkpoint from storage, trains, and
writes ``adapter/``, ``trainer/`` and ``training.json`` back. Its task carries the ``gpu`` tag, so a
tag concurrency limit (``prefect concurrency-limit create gpu 1``) keeps one update per GPU.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from tasks.run_config import RunConfig
from tasks.support.result_storage import result_storage_for
from tasks.support.runtime import close_runtime
from tasks.training import train_policy_fn, trained_here


@task(name="train-on-gpu", tags=["gpu"])
def _train(config: RunConfig, step: int) -> dict[str, Any]:
    return train_policy_fn(config, step)


@flow(name="train-step")
def train_step(config: RunConfig, step: int) -> dict[str, Any]:
    """One GRPO update of `config`'s run from checkpoint step-1 to step, on this worker's device."""
    local = trained_here(config)
    try:
        return _train.with_options(result_storage=result_storage_for(local))(local, step)
    finally:
        close_runtime(local)
