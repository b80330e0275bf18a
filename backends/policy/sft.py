"""A supervised warm start as a step of a run: SFT of the trainer's adapter (backends/training/sft.py), saved as
that step's checkpoint, resumable from save points in the run's storage. The flow makes it step 0 (``sft`` in the
RunConfig); ``LocalBackend.train_sft`` makes it the next step of a script's run.

Files under the step (names in storage/layout.py): each save point's ``sft-progress/<NNNNNN>/{adapter,trainer}/``, then
``sft-progress/progress.json`` naming it (written last, so a save point exists once progress.json names it; the one before
is removed after). When SFT is done: the step's ``adapter/``, ``trainer/`` and ``training.json`` as any step's,
``training.json`` carrying the SFT metrics and the record ``sft: {data_sha256, settings}``; then the save points
are removed. ``training.json`` present means done: SFT never runs twice. A resume whose demonstrations (content
hash) or settings differ from the record is refused, before anything is trained.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.policy.checkpoints import save_checkpoint, training_result
from backends.training.sft import run_sft
from backends.training.sft_config import SFTConfig
from backends.training.sft_data import BadLines, Demonstration
from storage.layout import SFT_PROGRESS, sft_save_point

log = logging.getLogger("trajflow")

SFT_RECORD = "sft"  # the key of the record in training.json and progress.json


def sft_record(data_sha256: str, config: SFTConfig) -> dict[str, Any]:
    """What makes an SFT'd policy what it is: the demonstrations' content hash and the identity settings."""
    return {"data_sha256": data_sha256, "settings": config.identity()}


def check_sft_record(recorded: dict[str, Any] | None, expected: dict[str, Any], where: str) -> None:
    """Refuse to continue `where` (a step, a saved progress) under other demonstrations or settings."""
    if recorded is None:
        raise ValueError(f"{where} was trained without sft; use a new run name (--set run=...) to warm-start with "
                         "SFT, or remove the sft section")
    if recorded.get("data_sha256") != expected["data_sha256"]:
        raise ValueError(f"sft.data changed since {where} was trained on it (content sha256 "
                         f"{str(recorded.get('data_sha256'))[:12]}... then, {expected['data_sha256'][:12]}... now); "
                         "use a new run name (--set run=...) or the original demonstrations")
    stored, now = recorded.get("settings") or {}, expected["settings"]
    changed = [f"{k}: {stored.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(stored) | set(now))
               if k in stored and stored.get(k) != now.get(k)]
    if changed:
        raise ValueError(f"sft settings changed since {where} was trained ({'; '.join(changed)}); use a new run name "
                         "(--set run=...) or the original settings")


def recorded_sft(store, step: int) -> dict[str, Any] | None:
    """The SFT record of `step`: its finished training.json's, else its saved progress's; None if neither has one."""
    finished = training_result(store, step)
    if finished is not None:
        return finished.get(SFT_RECORD)
    if store.exists(step, SFT_PROGRESS):
        return store.get_json(step, SFT_PROGRESS).get(SFT_RECORD)
    return None


def _delete_tree(store, step: int, prefix: str) -> None:
    for rel in store.list_files(step, prefix + "/"):
        store.delete(step, rel)


def sft_step(store, step: int, make_trainer: Callable[[], Any], demonstrations: list[Demonstration] | list[Any],
             config: SFTConfig, *, data_sha256: str, bad_lines: BadLines | None = None,
             after_save: Callable[[dict[str, Any]], None] | None = None,
             on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """SFT `make_trainer()`'s adapter on the demonstrations and store it as checkpoint `step`; the stored result if
    that step is already finished (`make_trainer` is then never called). `after_save(progress)` runs after each save
    point is stored (crash-point hook for tests). Returns the step's training.json."""
    record = sft_record(data_sha256, config)
    finished = training_result(store, step)
    if finished is not None:
        check_sft_record(finished.get(SFT_RECORD), record, f"step {step}")
        return finished
    progress = store.get_json(step, SFT_PROGRESS) if store.exists(step, SFT_PROGRESS) else None
    if progress is not None:
        check_sft_record(progress.get(SFT_RECORD), record, f"the saved SFT progress of step {step}")
    trainer = make_trainer()
    with tempfile.TemporaryDirectory(prefix="trajflow-sft-") as tmp:
        resume = None
        if progress is not None:
            resume = store.download_folder(step, progress["save_point"], Path(tmp) / "resume")
            log.info("SFT: resuming from %s after %d optimizer steps", progress["save_point"],
                     progress["optimizer_steps"])
        previous = progress["save_point"] if progress is not None else None

        def save(folder: Path, position: dict[str, Any]) -> None:
            nonlocal previous
            rel = sft_save_point(position["optimizer_steps"])
            store.upload_folder(step, rel, folder)
            store.put_json(step, SFT_PROGRESS, {**position, "save_point": rel, SFT_RECORD: record})
            if previous is not None and previous != rel:
                _delete_tree(store, step, previous)
            previous = rel
            if after_save is not None:
                after_save(position)

        options = config.model_dump(exclude={"epochs", "learning_rate"})
        metrics = run_sft(trainer, demonstrations, epochs=config.epochs, learning_rate=config.learning_rate,
                          bad_lines=bad_lines, resume_from=resume, save=save, on_progress=on_progress, **options)
    step_metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    result = save_checkpoint(store, step, trainer, step_metrics, extra={SFT_RECORD: record})
    if previous is not None:
        _delete_tree(store, step, previous)  # the step's checkpoint holds the adapter now; progress.json stays
    log.info("step %d: SFT done, loss per epoch %s", step,
             ", ".join(f"{x:.4f}" for x in metrics["loss_per_epoch"]))
    return result


def sft_metrics(training: dict[str, Any]) -> dict[str, float]:
    """The ``sft/*`` metrics of a step's training.json (empty for a step without SFT)."""
    return {k: v for k, v in (training.get("metrics") or {}).items() if k.startswith("sft/")}
