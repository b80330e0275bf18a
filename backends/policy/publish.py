"""Publishing a step: download its adapter (hash-checked), hot-load it as ``<run>@<step>``, prove it is served.

:func:`publish_step` is the one path the flow (``tasks/publish.py``) and LocalBackend both take:

1. the adapter is downloaded into a local cache, reusing a copy whose sha256 matches ``training.json``;
2. it is loaded into the inference server under ``<run>@<step>`` (idempotent);
3. the probe proves it (``backends/policy/probe.py``): against the step's probe record; for a
   ``training.json`` without one, against the trainer when the caller has one in its process, else by
   asking that the policy answer differently from ``<run>@<step-1>`` when the update moved it;
4. ``<run>@<step-keep_served>`` is unloaded, so a long run does not grow the server's adapter table
   (KEEP_SERVED by default; an async pipeline k steps off-policy keeps k+2, its rollouts still sample older steps).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.model import policy_name
from backends.modeling.loading import cache_root
from backends.policy.checkpoints import training_result
from backends.policy.probe import (
    PROBE_MESSAGES,
    PROBE_RECORD,
    PROBE_SEED,
    StaleAdapterError,
    check_answers,
    check_changed,
    check_record,
    check_with_trainer,
)
from storage.fs import sha256_local
from storage.layout import ADAPTER_DIR, ADAPTER_WEIGHTS_REL, SCORED

log = logging.getLogger("trajflow")

# A step is served while the next one trains and publishes; older ones are unloaded.
KEEP_SERVED = 2
# An update that moved the trained logprobs by less than this is not required to change answers (check 3).
MIN_SHIFT_TO_CHECK = 1e-2


def sha256_file(path: Path) -> str:
    return sha256_local(str(path))[0]


def adapter_cache(project: str, run: str) -> Path:
    """The local folder where a run's published adapters are downloaded, one subfolder per step, for the inference
    server to load (a server in another process must be allowed to read it)."""
    return cache_root() / "adapters" / project / run


def local_adapter(store, step: int, expected: dict[str, str] | None, project: str, run: str) -> Path:
    """Download the adapter of `step` into the local cache, reusing a copy whose hashes match."""
    target = adapter_cache(project, run) / f"{step:05d}"
    if expected and target.exists() and all(
        (target / name).exists() and sha256_file(target / name) == digest for name, digest in expected.items()
    ):
        return target
    store.download_folder(step, ADAPTER_DIR, target, verify=True)
    for name, digest in (expected or {}).items():
        actual = sha256_file(target / name)
        if actual != digest:
            raise StaleAdapterError(f"adapter file {target / name} has sha256 {actual[:12]}…, "
                                    f"the training step wrote {digest[:12]}…")
    return target


def probe_messages(store, step: int) -> list[dict[str, Any]]:
    """The opening messages of a trajectory this step trained on, or a fixed prompt (chat probes 2 and 3)."""
    groups = store.read_groups(step, SCORED) if step > 0 and store.exists(step, SCORED) else []
    for group in groups:
        for traj in group.trajectories:
            opening = []
            for message in traj.messages():
                if message.get("role") == "assistant":
                    break
                opening.append(message)
            if opening:
                return opening
    return PROBE_MESSAGES


async def publish(inference, client, name: str, previous: str | None, adapter_dir: Path, messages,
                  seed: int, trainer=None, tolerance: float | None = None,
                  record: dict[str, Any] | None = None) -> dict[str, float]:
    """Load `adapter_dir` as `name` and prove it is served: against the probe `record` when given, else with the
    in-process `trainer`, else against `previous` (None: no change expected); tolerance None: by dtype."""
    await inference.load_adapter(name, str(adapter_dir))
    if record is not None:
        return await check_record(client, name, record, tolerance)
    if trainer is not None:
        return await check_with_trainer(client, name, messages, seed, trainer, tolerance)
    if previous is not None:
        return await check_changed(client, name, previous, messages, seed)
    return await check_answers(client, name, messages, seed)


async def previous_policy(store, inference, run: str, step: int, training: dict[str, Any],
                          project: str) -> str | None:
    """What check 3 compares against: ``<run>@<step-1>`` (loaded if needed), else the base model.

    None when no visible change is expected: step 0, or an update whose own measured policy shift
    (``train/probe_shift``) is below MIN_SHIFT_TO_CHECK (e.g. every group had equal rewards).
    """
    shift = (training.get("metrics") or {}).get("train/probe_shift", 0.0)
    if step == 0 or shift < MIN_SHIFT_TO_CHECK:
        return None
    served = await inference.models()
    if policy_name(run, step - 1) in served or store.exists(step - 1, ADAPTER_WEIGHTS_REL):
        return (await ensure_loaded(store, inference, project, run, step - 1, served))[0]
    return next(m for m in served if "@" not in m)


async def ensure_loaded(store, inference, project: str, run: str, step: int,
                        served: list[str] | None = None) -> tuple[str, bool]:
    """``<run>@<step>`` servable: loaded from storage unless the server lists it (`served`, asked when None).

    Returns (name, whether it was loaded now). The adapter's hashes are not checked here: publish did that
    when the step was first served."""
    name = policy_name(run, step)
    if name in (await inference.models() if served is None else served):
        return name, False
    adapter = await asyncio.to_thread(local_adapter, store, step, None, project, run)
    await inference.load_adapter(name, str(adapter))
    return name, True


async def publish_step(store, inference, client, project: str, run: str, step: int,
                       training: dict[str, Any] | None = None, trainer: Callable[[], Any] | None = None,
                       tolerance: float | None = None, keep_served: int = KEEP_SERVED) -> dict[str, float]:
    """Make ``<run>@<step>`` servable and proven (module docstring); returns the probe metrics.

    `training` is the step's ``training.json`` (read from `store` when None). `trainer()` returns a trainer
    holding this step; it is called only for a ``training.json`` without a probe record.
    """
    training = training if training is not None else training_result(store, step) or {}
    name = policy_name(run, step)
    adapter = await asyncio.to_thread(local_adapter, store, step, training.get("adapter"), project, run)
    record = training.get(PROBE_RECORD)
    if record is not None:
        metrics = await publish(inference, client, name, None, adapter, None, 0, tolerance=tolerance, record=record)
    else:
        messages = await asyncio.to_thread(probe_messages, store, step)
        live = await asyncio.to_thread(trainer) if trainer is not None else None
        previous = None if live is not None else await previous_policy(store, inference, run, step, training, project)
        metrics = await publish(inference, client, name, previous, adapter, messages, PROBE_SEED + step,
                                trainer=live, tolerance=tolerance)
    if step >= keep_served:
        try:
            await inference.unload_adapter(policy_name(run, step - keep_served))
        except Exception as exc:  # noqa: BLE001 - an adapter that is already gone is fine
            log.debug("unload of %s skipped: %s", policy_name(run, step - keep_served), exc)
    return metrics
