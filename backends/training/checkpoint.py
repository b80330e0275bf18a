"""Trainer checkpoints: the adapter in peft's format plus everything needed to continue exactly.

Layout of a checkpoint folder::

    <path>/adapter/adapter_config.json          peft LoRA config (loadable by peft and vLLM)
    <path>/adapter/adapter_model.safetensors    LoRA weights (float32)
    <path>/trainer/state.pt                     optimizer + LR scheduler state, RNG states (torch.save,
                                                read back with weights_only=True: no pickled code)
    <path>/trainer/trainer.json                 step, TrainerConfig, base model, backend
    <path>/trainer/metrics.json                 per-step metrics so far

The names are storage/layout.py's, so a step folder in storage holds the same ``adapter/`` and ``trainer/``.

The folder is written under a temporary sibling name and renamed into place, so a crash never leaves a
half-written checkpoint at ``path`` (an existing one is replaced only once the new one is complete).
Local paths only; copying to object storage is the storage layer's job.
"""

from __future__ import annotations

import json
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from backends.training.config import TrainerConfig
from storage.layout import ADAPTER_DIR, ADAPTER_WEIGHTS, TRAINER_META, TRAINER_METRICS, TRAINER_STATE, TRAINER_STATE_DIR


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def write_checkpoint(
    path: str | Path,
    *,
    model,
    optimizer: torch.optim.Optimizer,
    scheduler,
    meta: dict[str, Any],
    metrics: list[dict[str, float]],
) -> Path:
    """Write adapter + trainer state atomically to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(str(tmp / ADAPTER_DIR))
        (tmp / TRAINER_STATE_DIR).mkdir(parents=True)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": capture_rng()},
            tmp / TRAINER_STATE_DIR / TRAINER_STATE,
        )
        (tmp / TRAINER_STATE_DIR / TRAINER_META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        (tmp / TRAINER_STATE_DIR / TRAINER_METRICS).write_text(json.dumps(metrics))
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], list]:
    """(adapter weights, trainer state, meta, metrics) of a checkpoint folder; clear errors if incomplete."""
    from safetensors.torch import load_file

    path = Path(path)
    trainer = path / TRAINER_STATE_DIR
    needed = [path / ADAPTER_DIR / ADAPTER_WEIGHTS, trainer / TRAINER_STATE, trainer / TRAINER_META]
    missing = [str(p.relative_to(path)) for p in needed if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint: missing {', '.join(missing)}")
    weights = load_file(str(needed[0]))
    state = torch.load(needed[1], map_location="cpu", weights_only=True)
    meta = json.loads(needed[2].read_text())
    metrics_file = trainer / TRAINER_METRICS
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else []
    return weights, state, meta, metrics


def check_compatible(saved_config: dict[str, Any], config: dict[str, Any], path) -> None:
    """A checkpoint resumes only under the same ``TrainerConfig.ADAPTER_SHAPE_FIELDS`` (rank, alpha, target modules)."""
    diffs = [f"{k}: checkpoint {saved_config.get(k)!r} vs now {config.get(k)!r}"
             for k in TrainerConfig.ADAPTER_SHAPE_FIELDS if saved_config.get(k) != config.get(k)]
    if diffs:
        raise ValueError(f"checkpoint {path} has a different adapter: " + "; ".join(diffs))
