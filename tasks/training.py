"""Training: one GRPO update of the LoRA adapter, from the checkpoint of step-1 to that of step.

The update reads the scored groups from storage, so it can run here (``training.mode=local``, the
default: in the flow's process on its device), in a child process that keeps its trainer between steps
(``training.mode=process``: ``tasks/support/trainer_process.py``, its own GIL while rollouts of later steps run here)
or on a GPU worker (``training.mode=deployment``: the ``train-step/gpu`` deployment of ``flows/train_step.py``);
all three run the same function and write the same files. The storage side (checkpoint upload, ``training.json`` written last) is
``backends.policy.checkpoints``, shared with LocalBackend. With ``training.gpus: N`` > 1 the update runs on N
processes under torchrun (``tasks/support/distributed_training.py``), started from here in either mode.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task

from backends.policy.checkpoints import initialize, train_step, training_result
from tasks.run_config import RunConfig
from tasks.support.cache_keys import cache_key_fn
from tasks.support.crash_points import crash_point
from tasks.support.deployment_attempts import DEFAULT_ATTEMPTS, POLL_S, run_deployment_until_complete
from tasks.support.distributed_training import train_distributed
from tasks.support.retry_policy import retry_condition
from tasks.support.runtime import get_runtime


def initialize_policy_fn(config: RunConfig) -> dict[str, Any]:
    """Step 0: the seeded initial adapter (LoRA B = 0, so it equals the base model) and optimizer state."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    if in_child(config):
        return training_result(rt.store, 0) or rt.trainer_process().request("initialize", 0)[0]
    if config.training.gpus > 1 and training_result(rt.store, 0) is None:
        train_distributed(config, 0)  # the training GPUs' processes write it: no trainer in this process
    return initialize(rt.store, rt.fresh_trainer)


# seconds measured inside the train task's body in this process, per (project, run, step): train_time_metrics
_BODY_SECONDS: dict[tuple[str, str, int], dict[str, float]] = {}


def _body_seconds(config: RunConfig, step: int) -> dict[str, float]:
    return _BODY_SECONDS.setdefault((config.project, config.run, step), {})


def pop_body_seconds(config: RunConfig, step: int) -> dict[str, float]:
    return _BODY_SECONDS.pop((config.project, config.run, step), {})


def training_mode(config: RunConfig) -> str:
    """``training.mode`` with ``auto`` resolved: ``process`` when rollouts of later steps run in this process while
    a step trains (``pipeline.max_off_policy_steps`` >= 1) and the update is one process on a GPU, else ``local``.
    Why not always: on the CPU a second process holds a second copy of the base weights, and a synchronous loop has
    nothing running beside the update."""
    mode = config.training.mode
    if mode != "auto":
        return mode
    from backends.modeling.devices import resolve_device

    beside = config.pipeline.max_off_policy_steps >= 1 and config.training.gpus == 1
    return "process" if beside and resolve_device(config.training.device).startswith("cuda") else "local"


def trained_here(config: RunConfig) -> RunConfig:
    """`config` with ``training.mode`` local: what a process that runs the update itself (the ``train-step``
    deployment, the trainer process) trains with, so that nothing in it hands the update on again."""
    return config.model_copy(update={"training": config.training.model_copy(update={"mode": "local"})})


def in_child(config: RunConfig) -> bool:
    """Whether this process hands its updates to a trainer process (``training.mode`` process; with ``training.gpus``
    > 1 the flow's process already starts the ranks as processes of their own, as in local mode)."""
    return config.training.gpus == 1 and training_mode(config) == "process"


def train_in_child(config: RunConfig, step: int) -> dict[str, Any]:
    """The update of `step` in the run's trainer process; its body's seconds counted as this task's."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    finished = training_result(rt.store, step)
    if finished is not None:  # finished before a kill: no trainer process started for nothing
        return finished
    result, seconds = rt.trainer_process().request("train", step)
    _body_seconds(config, step).update(seconds)
    return result


def train_policy_fn(config: RunConfig, step: int) -> dict[str, Any]:
    """Load checkpoint step-1, train on the scored groups of `step`, upload checkpoint `step`."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    finished = training_result(rt.store, step)
    if finished is not None:  # finished before a kill: never load a trainer, never train twice
        return finished
    seconds = _body_seconds(config, step)
    if config.training.gpus > 1:
        train_distributed(config, step)
        result = training_result(rt.store, step)
        if result is None:
            raise RuntimeError(f"training step {step}: torchrun succeeded but rank 0 stored no training result")
        seconds["trained"] = 1.0
        return result
    started = time.perf_counter()
    trainer = rt.trainer_at(step - 1)
    seconds["load"] = time.perf_counter() - started
    result = train_step(rt.store, step, trainer, after_update=lambda s: crash_point("training", s),
                        max_off_policy_steps=config.pipeline.max_off_policy_steps)
    rt.mark_trainer_step(step)
    seconds["trained"] = 1.0
    return result


def train_time_metrics(config: RunConfig, step: int, train_s: float, training: dict[str, Any]) -> dict[str, float]:
    """The flow's train stage, ``time/train_s`` = `train_s`, split (the train/* parts are in `training`'s metrics):

    - ``time/train_task_s``: the task's body in this process (0 when Prefect returned the cached result);
    - ``time/train_orchestration_s`` = train_s - task: Prefect's task run around it (the read of its tag's
      concurrency limit, tasks/support/tag_limits.py; cache key and lookup, state reports, result persistence);
    - ``time/train_load_s``: putting the trainer at checkpoint step-1 (0 when it already holds it);
    - ``time/train_other_s`` = task - load - ``train/stage_s``, when this body trained the step: the runtime and
      finished-step look-ups, the write of training.json (with ``training.gpus`` > 1 or a deployment: starting and
      waiting for the processes that train).
    """
    seconds = pop_body_seconds(config, step)
    task = seconds.get("task", 0.0)
    out = {"time/train_task_s": task, "time/train_orchestration_s": train_s - task,
           "time/train_load_s": seconds.get("load", 0.0)}
    stage = (training.get("metrics") or {}).get("train/stage_s")
    if seconds.get("trained") and stage is not None:
        out["time/train_other_s"] = task - out["time/train_load_s"] - stage
    return out


def train_remote(config: RunConfig, step: int, *, attempts: int = DEFAULT_ATTEMPTS,
                 poll_s: float = POLL_S) -> dict[str, Any]:
    """Run the update as the GPU deployment and read its result from storage; a crashed or lost run (a GPU
    machine reclaimed) is run again, at most `attempts` runs in all (tasks/support/deployment_attempts.py)."""
    store = get_runtime(config).store  # this process's resources for the run (tasks/support/runtime.py)
    return run_deployment_until_complete(
        config.training.deployment, {"config": config.model_dump(mode="json"), "step": step},
        lambda: training_result(store, step), what=f"training step {step}", timeout_s=config.training.timeout_s,
        attempts=attempts, poll_s=poll_s)


@task(name="train", cache_key_fn=cache_key_fn("training"), retries=2, retry_delay_seconds=[10, 60],
      retry_condition_fn=retry_condition, persist_result=True, tags=["trajflow-train"])
def train_policy(config: RunConfig, step: int) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        if config.training.mode == "deployment":
            return train_remote(config, step)
        if in_child(config):
            return train_in_child(config, step)
        return train_policy_fn(config, step)
    finally:
        _body_seconds(config, step)["task"] = time.perf_counter() - started
