"""A policy's checkpoints in a run's storage: step 0, one GRPO update per step, and loading a step back.

Per step (names in storage/layout.py): ``adapter/`` (peft safetensors), ``trainer/`` (optimizer, RNG,
scheduler), then ``training.json`` (metrics, adapter hashes, probe record), written last: its presence
means the update is finished, so every function here is idempotent once it exists. Step 0 is the seeded
initial adapter (LoRA B = 0, i.e. the base model). ``scored.parquet`` is what the step trained on.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.trajectory import TrajectoryGroup
from backends.policy.probe import PROBE_RECORD, probe_drafts, probe_prompt_ids, probe_record
from backends.policy.staleness import check_staleness
from storage.layout import ADAPTER_DIR, SCORED, TRAINER_STATE_DIR, TRAINING_RESULT

log = logging.getLogger("trajflow")


def training_result(store, step: int) -> dict[str, Any] | None:
    """The finished update of `step` (``training.json``), or None while it is not finished."""
    return store.get_json(step, TRAINING_RESULT) if store.exists(step, TRAINING_RESULT) else None


def timed_probe_record(trainer, prompt_ids: list[int] | None = None,
                       drafts: list[list[int]] = ()) -> tuple[dict[str, Any], dict[str, float]]:
    """The probe record continuing `prompt_ids` (None: the rendered probe messages; `drafts`: sampled completions of
    them, backends/policy/probe.py) and its metrics ``train/probe_record_s``, ``train/probe_forwards``."""
    started = time.perf_counter()
    record, forwards = probe_record(trainer, prompt_ids, drafts)
    return record, {"train/probe_record_s": time.perf_counter() - started, "train/probe_forwards": float(forwards)}


def save_checkpoint(store, step: int, trainer, metrics: dict[str, float],
                    probe_prompt_ids: list[int] | None = None, extra: dict[str, Any] | None = None,
                    record: dict[str, Any] | None = None, started: float | None = None) -> dict[str, Any]:
    """Upload the trainer's checkpoint as step `step`, then training.json (the 'finished' mark) with the probe
    `record` (None: made here by `timed_probe_record` continuing `probe_prompt_ids`) and the `extra` keys.

    Adds to `metrics`: ``train/save_s`` (checkpoint written and uploaded) and, from `started`
    (``time.perf_counter()`` at the start of the step; None: now), ``train/stage_s``: everything up to the write
    of training.json."""
    t0 = time.perf_counter()
    started = t0 if started is None else started
    if record is None:
        record, probe_metrics = timed_probe_record(trainer, probe_prompt_ids)
        metrics = {**metrics, **probe_metrics}
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        trainer.save_checkpoint(tmp)
        hashes = store.upload_folder(step, ADAPTER_DIR, Path(tmp) / ADAPTER_DIR)
        store.upload_folder(step, TRAINER_STATE_DIR, Path(tmp) / TRAINER_STATE_DIR)
    t2 = time.perf_counter()
    metrics = {**metrics, "train/save_s": t2 - t1, "train/stage_s": t2 - started}
    result = {**(extra or {}), "step": step, "metrics": metrics, "adapter": hashes, PROBE_RECORD: record}
    store.put_json(step, TRAINING_RESULT, result)
    return result


def initialize(store, make_trainer: Callable[[], Any]) -> dict[str, Any]:
    """Step 0: the seeded initial adapter and optimizer state; `make_trainer()` is called only when it is missing."""
    return training_result(store, 0) or save_checkpoint(store, 0, make_trainer(), {})


def load_checkpoint(store, step: int, trainer) -> None:
    """Put the trainer exactly in the state checkpointed at `step`."""
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        store.download_folder(step, ADAPTER_DIR, Path(tmp) / ADAPTER_DIR)
        store.download_folder(step, TRAINER_STATE_DIR, Path(tmp) / TRAINER_STATE_DIR)
        trainer.load_checkpoint(tmp)


def train_step(store, step: int, trainer, groups: list[TrajectoryGroup] | None = None,
               after_update: Callable[[int], None] | None = None, write: bool = True,
               max_off_policy_steps: int | None = None) -> dict[str, Any]:
    """One GRPO update from checkpoint step-1 to `step`; returns the stored result if it already finished.

    `groups` default to the step's stored ``scored.parquet``; given, they are stored there first.
    `after_update(step)` runs between the update and the upload (crash-point hook for tests).
    ``write=False`` (a data-parallel rank other than 0) takes its part of the update and stores nothing; it returns
    the trainer's raw metrics.
    A group sampled by a policy more than `max_off_policy_steps` steps before step-1 is refused before anything
    is stored or trained (StaleGroupError, backends/policy/staleness.py; None refuses none); the staleness of
    the groups is in the metrics (``pipeline/*``).

    Seconds of each part, in the metrics: ``train/groups_s`` (the finished check, reading the stored groups or
    storing the given ones), ``train/update_s``, ``train/probe_record_s`` (with ``train/probe_forwards``),
    ``train/policy_shift_s``, ``train/save_s``; ``train/stage_s`` is their total up to the write of training.json.
    """
    started = time.perf_counter()
    finished = training_result(store, step)
    if finished is not None:
        return finished
    stored = groups is None
    if stored:
        groups = store.read_groups(step, SCORED)
    staleness = check_staleness(groups, step, max_off_policy_steps)
    if not stored and write:
        store.write_groups(step, SCORED, groups)
    t_groups = time.perf_counter()
    raw = trainer.train_step(groups)
    t_update = time.perf_counter()
    if not write:
        return raw
    if after_update is not None:
        after_update(step)
    metrics = {(k if "/" in k else f"train/{k}"): float(v) for k, v in raw.items() if isinstance(v, (int, float))}
    metrics.update(staleness)
    prompt = probe_prompt_ids(groups)
    record, probe_metrics = timed_probe_record(trainer, prompt, probe_drafts(groups, prompt))
    shift_started = time.perf_counter()
    metrics["train/probe_shift"] = policy_shift(trainer, groups, record)
    metrics.update({"train/groups_s": t_groups - started, "train/update_s": t_update - t_groups,
                    "train/policy_shift_s": time.perf_counter() - shift_started, **probe_metrics})
    result = save_checkpoint(store, step, trainer, metrics, record=record, started=started)
    log.info("step %d trained: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:8]))
    return result


def policy_shift(trainer, groups: list[TrajectoryGroup], record: dict[str, Any] | None = None) -> float:
    """Max |log pi_new - log pi_sampler| over one trainable turn: how far this update moved the policy.

    The turn: one answering the probe `record`'s prompt with the first tokens of its greedy continuation, whose new
    logprobs the record already holds (no forward of its own); else the first trainable turn, scored by
    ``trainer.sequence_logprobs``. A publisher without a probe record or a trainer uses it to know whether the new
    policy must answer differently from the old one.
    """
    turns = [turn for group in groups for traj in group.trajectories if not traj.error
             for turn in traj.sampled_turns() if turn.trainable]
    for turn in turns if record else ():
        n = len(turn.token_ids)
        if (n and list(turn.prompt_token_ids) == record["prompt_token_ids"]
                and list(turn.token_ids) == record["token_ids"][:n]):
            return max(abs(a - b) for a, b in zip(record["logprobs"][:n], turn.logprobs))
    for turn in turns[:1]:
        new = trainer.sequence_logprobs(turn.prompt_token_ids, turn.token_ids)
        return max(abs(a - b) for a, b in zip(new, turn.logprobs))
    return 0.0
