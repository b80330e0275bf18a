"""SFT stage: with ``sft`` set, a run's step 0 is the adapter trained on demonstrations (backends/policy/sft.py),
published and probed like any step; the GRPO steps continue from it. Without ``sft`` step 0 is the seeded initial
adapter (tasks/training.py), as before.

The demonstrations are read from a local path or through the storage layer (``file://``, ``s3://``), never from the
web, and their sha256 is the data's identity: a run resumed (mid-SFT or after step 0) with another file is refused,
naming both hashes. SFT runs in one process on ``training.device`` (also with ``training.gpus`` > 1; the ranks then
start from step 0); with ``training.mode: deployment`` it is refused unless step 0 exists, since the flow's process
may have no GPU: run ``trajflow sft CONFIG --set training.mode=local`` on the GPU machine first.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from prefect import task

from backends.policy.checkpoints import training_result
from backends.policy.sft import check_sft_record, recorded_sft, sft_record, sft_step
from backends.training.sft_data import BadLines, Demonstration, DemonstrationError, parse_jsonl
from storage.errors import StorageError
from storage.fs import read_url
from tasks.run_config import RunConfig
from tasks.support.cache_keys import cache_key_fn
from tasks.support.crash_points import crash_point
from tasks.support.retry_policy import retry_condition
from tasks.support.runtime import get_runtime
from tasks.training import in_child

log = logging.getLogger("trajflow")


def read_demonstration_bytes(config: RunConfig) -> bytes:
    """The bytes of ``sft.data``; a file that cannot be read is a DemonstrationError naming it and why."""
    try:
        return read_url(config.sft.data)
    except StorageError as exc:
        raise DemonstrationError(f"sft.data: {exc}") from None


def load_demonstrations(config: RunConfig) -> tuple[list[Demonstration], BadLines, str]:
    """(demonstrations, the bad lines skipped, the file's sha256) of ``sft.data``; errors name the line."""
    raw = read_demonstration_bytes(config)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DemonstrationError(f"{config.sft.data}: not UTF-8 text (byte {exc.start})") from None
    bad = BadLines(config.sft.on_bad_line)
    demos = parse_jsonl(text, config.sft.data, bad)
    return demos, bad, hashlib.sha256(raw).hexdigest()


def check_sft_identity(config: RunConfig, store) -> None:
    """Refuse to continue a run whose step 0 (finished or in progress) was trained on other demonstrations or
    settings, or without SFT while ``sft`` is set now (and the other way round)."""
    recorded = recorded_sft(store, 0)
    started = training_result(store, 0) is not None or recorded is not None
    if config.sft is None:
        if recorded is not None:
            raise ValueError(f"step 0 of run {config.project}/{config.run} was trained with sft; keep its sft section "
                             "(or use a new run name)")
        return
    if not started:
        return
    sha = hashlib.sha256(read_demonstration_bytes(config)).hexdigest()
    check_sft_record(recorded, sft_record(sha, config.sft.settings()), "step 0")


def sft_policy_fn(config: RunConfig) -> dict[str, Any]:
    """Step 0 as the SFT'd adapter: trained (or resumed from its last save point) and checkpointed; the stored
    result once finished."""
    rt = get_runtime(config)  # this process's resources for the run (tasks/support/runtime.py)
    if in_child(config):  # the trainer process runs this function (its own checks, save points, resume)
        return rt.trainer_process().request("sft", 0)[0]
    demos, bad, sha = load_demonstrations(config)
    if config.training.mode == "deployment" and training_result(rt.store, 0) is None:
        raise ValueError("sft with training.mode=deployment: the flow's process would train it, maybe without a GPU; "
                         "run `trajflow sft CONFIG --set training.mode=local` on the GPU machine first (it stores "
                         "step 0), then this flow")

    return sft_step(rt.store, 0, rt.fresh_trainer, demos, config.sft.settings(), data_sha256=sha, bad_lines=bad,
                    after_save=lambda progress: crash_point("sft-saved", progress["optimizer_steps"]))


@task(name="sft", cache_key_fn=cache_key_fn("sft"), retries=2, retry_delay_seconds=[10, 60],
      retry_condition_fn=retry_condition, persist_result=True, tags=["trajflow-train"])
def sft_policy(config: RunConfig, step: int) -> dict[str, Any]:
    """The SFT stage as a task of step 0 (its result cached as ``<run>/step-00000/sft-v1``)."""
    if step != 0:
        raise ValueError(f"the SFT stage makes step 0, not step {step}")
    return sft_policy_fn(config)
