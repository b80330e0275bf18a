"""The training flow: `trajflow train CONFIG` or `python -m flows.train CONFIG [--set k=v ...]`.

Each step k (1-based; step 0 is the seeded initial adapter, or with ``sft`` the adapter trained on demonstrations,
tasks/sft.py) is a chain of cached tasks:
sample scenarios -> rollouts with policy <run>@<k-1> -> score -> GRPO update -> publish <run>@<k>
(-> evaluate every `eval_every` steps) -> commit (manifest written last) -> retention -> artifacts.

One writer per run: the flow holds the run's lease (storage/lease.py) from start to end, so a second
`trajflow train` on the same run stops at once, naming the holder; a run whose process was killed or
preempted is taken over once its lease expires (or at once on the same host). SIGTERM (a spot reclaim) stops the
flow at the next stage or between rollout groups, logs "preempted at step N", releases the lease and ends the run
Crashed (tasks/support/preemption.py). ``run.json`` is written
once step 0 exists, so a first start that fails (a typo in base_model) leaves the run name free.

Async pipeline (``pipeline.max_off_policy_steps`` = k > 0): the rollouts of step s are sampled by <run>@<max(0, s-1-k)>
instead, so the rollouts of the next k steps run as submitted tasks while the current step trains
(tasks/pipeline.py); the trainer refuses a group staler than the bound (backends/policy/staleness.py).

Resume: the flow starts from the last committed step. Within an uncommitted step, every stage whose
result was persisted (its Prefect cache record and its files live in the run's storage) is reused,
and the rollout task re-runs only the groups that were not yet stored. The scenario cursor, LoRA init
and every sampling seed derive from (seed, run, step), and the optimizer and RNG states come from the
previous checkpoint, so where the run was killed does not change its result.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from typing import Any

from prefect import flow

from agents.group_metrics import merge_step_metrics
from backends.policy.checkpoints import training_result
from backends.policy.sft import sft_metrics
from flows.arguments import train_parser
from flows.command import run_flow_command
from flows.console import announce_flow_run
from flows.deployment_defaults import with_deployment_defaults
from flows.preflight import check_run
from flows.summary import json_result, train_summary
from storage.lease import RunLease
from tasks.evaluation import evaluate_policy
from tasks.pipeline import RolloutsAhead
from tasks.publish import publish_policy
from tasks.run_config import RunConfig, check_run_identity
from tasks.sft import check_sft_identity, sft_policy
from tasks.support.crash_points import crash_point
from tasks.support.placement import describe as describe_placement
from tasks.support.placement import visible_gpus
from tasks.support.preemption import graceful_sigterm, stop_if_requested
from tasks.support.progress import flush_progress
from tasks.support.reporting import format_step_line, publish_run_artifacts
from tasks.support.result_storage import result_storage_for
from tasks.support.runtime import close_runtime, get_runtime
from tasks.support.tag_limits import with_tag_limits
from tasks.support.tracking import track_step
from tasks.training import in_child, initialize_policy_fn, train_policy, train_time_metrics

log = logging.getLogger("trajflow")


class StageTimer:
    """Wall time per stage of a step, reported as time/<stage>_s and time/step_s; `before_stage(stage)` runs as
    each stage starts (the safe point: a process that lost the run's lease, or got SIGTERM, stops there).

    With the async pipeline the rollouts and score stages run ahead as submitted tasks, so their time here is the
    loop's wait for them, not their duration (which the task runs in the Prefect UI show).
    """

    def __init__(self, before_stage=None):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.before_stage = before_stage

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.before_stage is not None:
            self.before_stage(stage)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = time.perf_counter() - self.started
        return out


def _evaluate_due(config: RunConfig, step: int) -> bool:
    if step == 0:
        return config.eval_at_start
    return config.eval_every > 0 and (step % config.eval_every == 0 or step == config.steps)


@flow(name="train", log_prints=True)
def train(config: RunConfig) -> dict[str, Any]:
    """Train `config.agent` until `config.steps` steps are committed.

    Returns {step: the last committed step, metrics: its metrics, resumed_from: the last step committed before
    this run (None for a new run), flow_run_url: its page in the Prefect UI or None}.
    """
    config = with_deployment_defaults(config)  # a partial config from `prefect deployment run -p` fills in
    flow_run_url = announce_flow_run()
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    store = rt.store
    storage = result_storage_for(config)
    lease = RunLease(store, "trajflow train").acquire()

    def with_run_storage(task):
        """`task` with its results persisted in the run's storage: what lets a rerun reuse them."""
        return task.with_options(result_storage=storage)

    try:
        with graceful_sigterm():
            return _train_steps(config, store, lease, with_run_storage, flow_run_url)
    finally:
        flush_progress()  # the progress artifacts still queued reach the API before the flow run ends
        lease.release()
        close_runtime(config)


def _safe_point(lease: RunLease, step: int, stage: str) -> None:
    """Before each stage: stop if SIGTERM came (the run is marked Crashed) or the run's lease was lost."""
    stop_if_requested(step, stage)
    lease.check()


def _train_steps(config: RunConfig, store, lease: RunLease, with_run_storage, flow_run_url) -> dict[str, Any]:
    """Step 0 (or the resume point), then every step up to `config.steps`, each committed before the next."""
    check_run_identity(store.read_run_config(), config)
    check_sft_identity(config, store)
    # the GPUs there are, not visible_gpus(config): that skips torch and counts none where every device is 'auto',
    # which the runtime resolves to cuda:0 on a GPU machine
    log.info("placement: %s", describe_placement(config, visible_gpus()))
    committed = store.committed_steps()
    last = committed[-1] if committed else None
    resumed_from = last
    if last is None:
        if config.sft is not None:  # step 0 is the SFT'd adapter (tasks/sft.py)
            training = with_tag_limits(with_run_storage(sft_policy))(config, 0)
        else:
            training = initialize_policy_fn(config)
        store.write_run_config(config.model_dump(mode="json"))  # step 0 exists: the run is this config's now
        publish = with_run_storage(publish_policy)(config, 0, training)
        metrics = {**sft_metrics(training), **publish["metrics"]}
        if _evaluate_due(config, 0):
            metrics.update(with_run_storage(evaluate_policy)(config, 0))
        lease.check(fresh=True)
        store.commit(0, metrics, extra={"policy": config.policy(0)})
        track_step(config, 0, metrics)
        log.info("%s", format_step_line(0, metrics, config.policy(0)))
        last = 0
    else:
        metrics = store.read_manifest(last).metrics
        store.write_run_config(config.model_dump(mode="json"))
        training = training_result(store, last)
        with_run_storage(publish_policy)(config, last, training)
        log.info("resuming %s/%s after committed step %d", config.project, config.run, last)
        if in_child(config):  # the trainer process loads the model while the first rollouts run
            get_runtime(config).trainer_process().preload(last)
    # with pipeline.max_off_policy_steps > 0 the rollouts of later steps run meanwhile (tasks/pipeline.py)
    with RolloutsAhead(config, with_run_storage) as ahead:
        for step in range(last + 1, config.steps + 1):
            timer = StageTimer(before_stage=lambda stage, step=step: _safe_point(lease, step, stage))
            with timer("sample"):
                ahead.scenarios(step)
            with timer("rollouts"):
                rollouts = ahead.rollouts(step)
            with timer("score"):
                scored = ahead.scored(step, rollouts)
            with timer("train"):
                training = with_tag_limits(with_run_storage(train_policy))(config, step)
            with timer("publish"):
                publish = with_run_storage(publish_policy)(config, step, training)
            metrics = merge_step_metrics(scored["metrics"], training["metrics"], publish["metrics"])
            metrics["rollouts/reused_groups"] = float(rollouts["reused_groups"])
            if _evaluate_due(config, step):
                with timer("evaluate"):
                    metrics.update(with_run_storage(evaluate_policy)(config, step))
            metrics.update(timer.metrics())
            metrics.update(train_time_metrics(config, step, timer.seconds["train"], training))
            crash_point("before-commit", step)
            lease.check(fresh=True)
            store.commit(step, metrics, extra={"policy": config.policy(step)})
            track_step(config, step, metrics)
            pruned = store.apply_retention(config.retention.keep_last, config.retention.best_metric,
                                           config.retention.mode)
            if pruned:
                log.info("retention pruned checkpoints of steps %s", pruned)
            publish_run_artifacts(store)
            log.info("%s", format_step_line(step, metrics, config.policy(step)))
    return {"step": store.latest_step(), "metrics": metrics, "resumed_from": resumed_from,
            "flow_run_url": flow_run_url}


def run_command(args: argparse.Namespace) -> int:
    """`trajflow train` and `python -m flows.train`: run the flow, end with a summary (or one JSON line with --json)."""

    def body(config: RunConfig, log_file) -> str:
        result = train(config)
        return json_result(config, result, log_file) if args.json else train_summary(config, args, result, log_file)

    return run_flow_command("trajflow train", args, body, check_run)


if __name__ == "__main__":
    sys.exit(run_command(train_parser().parse_args()))
