"""Supervised fine-tuning (SFT) of the trainer's own LoRA adapter on demonstrations: the warm start before GRPO.

Loss (token-level cross-entropy, the mean over the trained tokens of one optimizer step):
``L = -(1/N) * sum_{t trained} log pi(x_t | x_<t)``, N the trained tokens of the step's conversations, with the raw
logits (temperature 1, whatever ``TrainerConfig.temperature`` the GRPO steps use). Each row's tokens carry the weight
1/N, so the packed micro-batches' gradients add up to the step's gradient, as the GRPO step's do.

Rows are the exact-token rows of ``sft_rows.py`` (the chat template's render, assistant turns trained), packed by the
trainer's ``micro_batches`` (no padding), through the trainer's own forward and logprob code. Each epoch visits the
conversations in an order seeded by (``seed``, epoch), ``batch_size`` conversations per AdamW step.

Choices (numbered simplifications):

1. The optimizer is SFT's own AdamW (its learning rate, constant; the trainer's betas, eps, weight decay and gradient
   clip), made fresh for SFT and dropped after it: the GRPO steps then start with their own fresh optimizer state and
   schedule (``trainer.step`` stays 0), as ART resets the optimizer when it switches from SFT to RL. The adapter is
   the one thing the two share.
2. One process: a data-parallel job (``training.gpus`` > 1) runs SFT on its first device before the ranks start.
3. Progress is saved (adapter, SFT optimizer, RNG, position, the losses so far) at the end of every epoch and every
   ``save_every_steps`` steps through the caller's ``save(folder, progress)``; ``resume_from`` continues from such a
   folder exactly, so a killed SFT redoes at most the steps since its last save and never a finished epoch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from backends.modeling.chat_render import end_of_turn_ids
from backends.training import distributed
from backends.training.checkpoint import read_checkpoint, restore_rng, write_checkpoint
from backends.training.sft_config import SFTConfig
from backends.training.sft_data import BadLines, Demonstration, DemonstrationError, demonstrations_of
from backends.training.sft_rows import demonstration_rows
from backends.training.token_rows import TrainingRow

log = logging.getLogger("trajflow")

PROGRESS_FORMAT = 1


def rows_fingerprint(rows: Sequence[TrainingRow]) -> str:
    """sha256 over the rows' token ids and masks: what the SFT trains on, whatever file or script it came from."""
    h = hashlib.sha256()
    for row in rows:
        h.update(repr((row.token_ids, row.loss_mask)).encode())
    return h.hexdigest()


def context_limit(trainer, max_length: int | None) -> int:
    """The longest row SFT takes: the smaller of `max_length` and the model's max positions."""
    positions = getattr(trainer.causal_lm.config, "max_position_embeddings", None) or math.inf
    return int(min(max_length or math.inf, positions))


class _Position:
    """Where SFT is: optimizer steps done in all, and the running loss sums of the current epoch."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.done = 0
        self.loss_sum = 0.0  # sum over the epoch's steps of (step loss * its trained tokens)
        self.trained = 0
        self.epoch_losses: list[float] = []

    @property
    def epoch(self) -> int:
        return self.done // self.steps_per_epoch

    @property
    def batch(self) -> int:
        return self.done % self.steps_per_epoch

    def as_dict(self) -> dict[str, Any]:
        return {"format": PROGRESS_FORMAT, "optimizer_steps": self.done, "epoch": self.epoch, "batch": self.batch,
                "epoch_loss_sum": self.loss_sum, "epoch_trained_tokens": self.trained,
                "epoch_losses": list(self.epoch_losses)}

    def restore(self, saved: dict[str, Any]) -> None:
        self.done = int(saved["optimizer_steps"])
        self.loss_sum = float(saved["epoch_loss_sum"])
        self.trained = int(saved["epoch_trained_tokens"])
        self.epoch_losses = [float(x) for x in saved["epoch_losses"]]


def _demonstrations(conversations: Iterable[Any], bad: BadLines) -> list[Demonstration]:
    items = list(conversations)
    if items and all(isinstance(c, Demonstration) for c in items):
        return items
    return demonstrations_of(items, bad)


def _optimizer(trainer, config: SFTConfig) -> torch.optim.Optimizer:
    tc = trainer.config
    return torch.optim.AdamW(trainer.trainable_parameters, lr=config.learning_rate, betas=tuple(tc.adam_betas),
                             eps=tc.adam_eps, weight_decay=tc.weight_decay,
                             **({"fused": True} if trainer.device.type == "cuda" else {}))


def _step(trainer, optimizer, rows: list[TrainingRow], budget: int | None) -> tuple[float, int, float]:
    """One AdamW step on `rows`: (mean loss per trained token, trained tokens, gradient norm)."""
    trained = sum(r.trained_tokens for r in rows)
    for r in rows:
        r.weight = 1.0 / trained
    optimizer.zero_grad(set_to_none=True)
    trainer.model.train()
    total = torch.zeros((), device=trainer.device)
    with trainer.lora_casts_scope():  # the LoRA weights' compute copies made once for the step's micro-batches
        for mb in trainer.micro_batches(rows, budget):
            logp = trainer.token_logprobs(mb, temperature=1.0)
            loss = -(logp * mb.weights).sum()
            loss.backward()
            total += loss.detach()
    loss = float(total)
    params = trainer.trainable_parameters
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, trainer.config.grad_clip or math.inf))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"SFT: non-finite loss ({loss}) or gradient norm ({grad_norm}) on "
                                 f"{'; '.join(r.source for r in rows)}; no optimizer step was taken")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, trained, grad_norm


def _load_progress(trainer, optimizer, scheduler, folder: str | Path, fingerprint: str,
                   identity: dict[str, Any]) -> dict[str, Any]:
    from peft import set_peft_model_state_dict

    weights, state, meta, _ = read_checkpoint(folder)
    saved = meta.get("sft") or {}
    if saved.get("rows_fingerprint") != fingerprint:
        raise ValueError(f"SFT progress in {folder} was saved for other demonstrations (their tokens differ): "
                         "train them under a new run name, or restore the original demonstrations")
    if saved.get("settings") != identity:
        raise ValueError(f"SFT progress in {folder} was saved under other settings ({saved.get('settings')} vs now "
                         f"{identity}): use a new run name or the original settings")
    set_peft_model_state_dict(trainer.model, weights)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    return saved["position"]


def run_sft(trainer, conversations: Iterable[Any], *, epochs: int, learning_rate: float,
            bad_lines: BadLines | None = None, resume_from: str | Path | None = None,
            save: Callable[[Path, dict[str, Any]], None] | None = None,
            on_progress: Callable[[dict[str, Any]], None] | None = None, **options: Any) -> dict[str, Any]:
    """Train `trainer`'s own LoRA adapter on `conversations` in place; returns the metrics.

    `conversations`: demonstration dicts (``{"messages", "tools"?, "metadata"?}``), ART-style Trajectory objects, or
    the Demonstrations of ``sft_data.parse_jsonl`` (whose `bad_lines` then carries the file's skips). `options` are
    the other ``SFTConfig`` fields (batch_size, micro_batch_tokens, max_length, on_bad_line, seed, save_every_steps,
    log_every_steps). `save(folder, progress)` is called at each save point with a complete progress checkpoint
    (deleted after the call); `resume_from` is such a folder. `on_progress(event)` gets every optimizer step
    (``{"event": "step", ...}``) and epoch (``{"event": "epoch", ...}``).

    Metrics: ``sft/loss`` (the last epoch's mean loss per trained token), ``sft/loss_epoch_<k>`` (1-based),
    ``sft/tokens`` and ``sft/trained_tokens`` (per epoch), ``sft/conversations``, ``sft/skipped``,
    ``sft/optimizer_steps`` (in all), ``sft/steps_run`` (by this call), ``sft/time_s``; plus ``loss_per_epoch`` (a
    list) and ``skipped`` (the reasons).
    """
    config = SFTConfig(epochs=epochs, learning_rate=learning_rate, **options)
    started = time.perf_counter()
    if distributed.world()[1] > 1:
        raise RuntimeError("SFT runs in one process; run it before starting the data-parallel ranks")
    bad = bad_lines if bad_lines is not None else BadLines(config.on_bad_line)
    bad.mode = config.on_bad_line
    demos = _demonstrations(conversations, bad)
    end_ids = end_of_turn_ids(trainer.causal_lm, trainer.tokenizer)
    rows = demonstration_rows(trainer.tokenizer, demos, end_ids, context_limit(trainer, config.max_length), bad)
    if bad.skipped:
        log.warning("SFT: skipped %d bad demonstration(s); the first: %s", len(bad.skipped), bad.skipped[0])
    if not rows:
        raise DemonstrationError(f"no usable demonstration ({len(bad.skipped)} skipped"
                                 + (f"; the first: {bad.skipped[0]})" if bad.skipped else ")"))
    fingerprint = rows_fingerprint(rows)
    optimizer = _optimizer(trainer, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant; kept for the checkpoint
    steps_per_epoch = math.ceil(len(rows) / config.batch_size)
    pos = _Position(steps_per_epoch)
    if resume_from is not None:
        pos.restore(_load_progress(trainer, optimizer, scheduler, resume_from, fingerprint, config.identity()))
        log.info("SFT resumes after %d optimizer steps (epoch %d, batch %d)", pos.done, pos.epoch + 1, pos.batch)

    def save_point() -> None:
        if save is None:
            return
        meta = {"format": PROGRESS_FORMAT, "base_model": trainer.base_model,
                "config": trainer.config.model_dump(mode="json"),
                "sft": {"rows_fingerprint": fingerprint, "settings": config.identity(), "position": pos.as_dict()}}
        with tempfile.TemporaryDirectory(prefix="trajflow-sft-") as tmp:
            folder = write_checkpoint(Path(tmp) / "progress", model=trainer.model, optimizer=optimizer,
                                      scheduler=scheduler, meta=meta, metrics=[])
            save(folder, pos.as_dict())

    steps_run = 0
    total = steps_per_epoch * config.epochs
    while pos.done < total:
        epoch, batch = pos.epoch, pos.batch
        order = list(range(len(rows)))
        random.Random(config.seed * 1_000_003 + epoch).shuffle(order)
        chosen = [rows[i] for i in order[batch * config.batch_size:(batch + 1) * config.batch_size]]
        loss, trained, grad_norm = _step(trainer, optimizer, chosen, config.micro_batch_tokens)
        pos.done += 1
        steps_run += 1
        pos.loss_sum += loss * trained
        pos.trained += trained
        event = {"event": "step", "epoch": epoch + 1, "step": pos.done, "of": total, "loss": loss,
                 "grad_norm": grad_norm, "trained_tokens": trained}
        if config.log_every_steps and pos.done % config.log_every_steps == 0:
            log.info("SFT step %d/%d (epoch %d): loss %.4f, grad norm %.3g", pos.done, total, epoch + 1, loss,
                     grad_norm)
        if on_progress is not None:
            on_progress(event)
        if pos.batch == 0:  # the epoch just ended
            pos.epoch_losses.append(pos.loss_sum / max(pos.trained, 1))
            pos.loss_sum, pos.trained = 0.0, 0
            log.info("SFT epoch %d/%d: loss %.4f", epoch + 1, config.epochs, pos.epoch_losses[-1])
            if on_progress is not None:
                on_progress({"event": "epoch", "epoch": epoch + 1, "of": config.epochs,
                             "loss": pos.epoch_losses[-1]})
            save_point()
        elif config.save_every_steps and pos.done % config.save_every_steps == 0:
            save_point()
    tokens = sum(len(r) for r in rows)
    metrics: dict[str, Any] = {
        "sft/loss": pos.epoch_losses[-1],
        **{f"sft/loss_epoch_{k}": v for k, v in enumerate(pos.epoch_losses, start=1)},
        "sft/tokens": float(tokens),
        "sft/trained_tokens": float(sum(r.trained_tokens for r in rows)),
        "sft/conversations": float(len(rows)),
        "sft/skipped": float(len(bad.skipped)),
        "sft/optimizer_steps": float(pos.done),
        "sft/steps_run": float(steps_run),
        "sft/time_s": time.perf_counter() - started,
        "loss_per_epoch": list(pos.epoch_losses),
        "skipped": list(bad.skipped),
    }
    return metrics
