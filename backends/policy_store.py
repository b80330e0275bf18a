"""A policy's life in storage, shared by the Prefect flow and the ART-style LocalBackend.

Layout inside a step folder (see storage/): ``adapter/`` (peft safetensors), ``trainer/`` (optimizer,
RNG, scheduler), ``training.json`` (metrics + adapter hashes, written last: the update is finished),
``scored.parquet`` (what was trained on). Step 0 is the seeded initial adapter (LoRA B = 0, i.e. the
base model). Publishing downloads an adapter into a local cache (checked against the recorded hashes),
hot-loads it as ``<name>@<step>`` and probes it: the server's logprobs of its own greedy answer must
match the trainer's within a tolerance, so a stale adapter is an error, not a silent failure.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from agents.trajectory import TrajectoryGroup
from storage.fs import sha256_local

from .models import cache_root

log = logging.getLogger("trajflow")

ADAPTER = "adapter"
TRAINER_STATE = "trainer"
TRAINING_RESULT = "training.json"
SCORED = "scored.parquet"
PROBE_MESSAGES = [{"role": "user", "content": "Say something."}]
PROBE_USER = "trajflow-publish-probe"  # marks probe requests in server logs


class StaleAdapterError(RuntimeError):
    """The server does not answer with the adapter the trainer just wrote."""


def sha256_file(path: Path) -> str:
    return sha256_local(str(path))[0]


def save_checkpoint(store, step: int, trainer, metrics: dict[str, float]) -> dict[str, Any]:
    """Upload the trainer's checkpoint as step `step`, then training.json (the 'finished' mark)."""
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        trainer.save_checkpoint(tmp)
        hashes = store.upload_folder(step, ADAPTER, Path(tmp) / ADAPTER)
        store.upload_folder(step, TRAINER_STATE, Path(tmp) / TRAINER_STATE)
    result = {"step": step, "metrics": metrics, "adapter": hashes}
    store.put_json(step, TRAINING_RESULT, result)
    return result


def load_checkpoint(store, step: int, trainer) -> None:
    """Put the trainer exactly in the state checkpointed at `step`."""
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        store.download_folder(step, ADAPTER, Path(tmp) / ADAPTER)
        store.download_folder(step, TRAINER_STATE, Path(tmp) / TRAINER_STATE)
        trainer.load_checkpoint(tmp)


def train_step(store, step: int, trainer, groups: list[TrajectoryGroup] | None = None,
               after_update=None) -> dict[str, Any]:
    """One GRPO update from checkpoint step-1 to `step`; idempotent once training.json exists.

    `groups` default to the step's stored ``scored.parquet``; given, they are stored there first.
    `after_update(step)` runs between the update and the upload (crash-point hook for tests).
    """
    if store.exists(step, TRAINING_RESULT):
        return store.get_json(step, TRAINING_RESULT)
    if groups is None:
        groups = store.read_groups(step, SCORED)
    else:
        store.write_groups(step, SCORED, groups)
    started = time.perf_counter()
    raw = trainer.train_step(groups)
    update_s = time.perf_counter() - started
    if after_update is not None:
        after_update(step)
    metrics = {(k if "/" in k else f"train/{k}"): float(v) for k, v in raw.items() if isinstance(v, (int, float))}
    metrics["train/update_s"] = update_s
    metrics["train/probe_shift"] = policy_shift(trainer, groups)
    result = save_checkpoint(store, step, trainer, metrics)
    log.info("step %d trained: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:8]))
    return result


def policy_shift(trainer, groups: list[TrajectoryGroup]) -> float:
    """Max |log pi_new - log pi_sampler| over the first trainable turn: how far this update moved the policy.

    A remote publisher uses it to know whether the new policy must answer differently from the old one.
    """
    for group in groups:
        for traj in group.trajectories:
            for turn in traj.sampled_turns():
                if turn.trainable and not traj.error:
                    new = trainer.sequence_logprobs(turn.prompt_token_ids, turn.token_ids)
                    return max(abs(a - b) for a, b in zip(new, turn.logprobs))
    return 0.0


def local_adapter(store, step: int, expected: dict[str, str] | None, project: str, run: str) -> Path:
    """Download the adapter of `step` into the local cache, reusing a copy whose hashes match."""
    target = cache_root() / "adapters" / project / run / f"{step:05d}"
    if expected and target.exists() and all(
        (target / name).exists() and sha256_file(target / name) == digest for name, digest in expected.items()
    ):
        return target
    store.download_folder(step, ADAPTER, target, verify=True)
    for name, digest in (expected or {}).items():
        actual = sha256_file(target / name)
        if actual != digest:
            raise StaleAdapterError(f"adapter file {target / name} has sha256 {actual[:12]}…, "
                                    f"the training step wrote {digest[:12]}…")
    return target


def probe_messages(store, step: int) -> list[dict[str, Any]]:
    """The opening messages of a trajectory this step trained on, or a fixed prompt."""
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


PROBE_TOKENS = 16


async def _sample(client, model: str, messages, seed: int) -> tuple[list[int], list[int], list[float]]:
    """Greedy probe answer: (prompt ids, token ids, raw logprobs). Greedy tokens are likely ones, whose
    logprobs move least under bf16 rounding (dlogp ~ (1 - p) dz): on an H200, temperature-1 probes of 8
    tokens differed from the trainer by up to 0.24 in bf16, which no useful tolerance separates from a
    stale adapter."""
    resp = await client.chat.completions.create(model=model, messages=messages, max_tokens=PROBE_TOKENS,
                                                temperature=0.0, seed=seed, logprobs=True, user=PROBE_USER)
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    prompt_ids = list(extra.get("prompt_token_ids") or (resp.model_extra or {}).get("prompt_token_ids") or [])
    token_ids = list(extra.get("token_ids") or [])
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    return prompt_ids, token_ids, [e.logprob for e in content]


# Probe tolerance on max |server - trainer| logprob when none is configured, by the trainer's dtype.
# float32 (CPU): measured 2e-5..4e-5 on SmolLM2. bfloat16 (GPU): both sides compute float32 logits, but
# hidden states differ by bf16 rounding between the engine's and the trainer's kernels.
AUTO_PROBE_TOLERANCE = {"float32": 0.05, "bfloat16": 0.25}


def probe_tolerance(trainer, configured: float | None) -> float:
    if configured is not None:
        return configured
    dtype = str(getattr(trainer, "dtype", "torch.float32")).removeprefix("torch.")
    return AUTO_PROBE_TOLERANCE.get(dtype, AUTO_PROBE_TOLERANCE["bfloat16"])


async def publish(inference, client, name: str, previous: str | None, adapter_dir: Path, messages,
                  seed: int, trainer=None, tolerance: float | None = None) -> dict[str, float]:
    """Load `adapter_dir` as `name` and prove it is served (see module docstring); tolerance None: by dtype."""
    await inference.load_adapter(name, str(adapter_dir))
    prompt_ids, token_ids, served = await _sample(client, name, messages, seed)
    if not token_ids or len(served) != len(token_ids):
        raise StaleAdapterError(f"probe of {name} returned no token ids/logprobs; the server does not speak "
                                "the dialect (return_token_ids + logprobs)")
    metrics: dict[str, float] = {}
    if trainer is not None:
        expected = trainer.sequence_logprobs(prompt_ids, token_ids)
        diffs = [abs(a - b) for a, b in zip(served, expected)]
        diff, tolerance = max(diffs), probe_tolerance(trainer, tolerance)
        metrics["publish/probe_max_abs_diff"] = diff
        metrics["publish/probe_mean_abs_diff"] = sum(diffs) / len(diffs)
        metrics["publish/probe_tolerance"] = tolerance
        if diff > tolerance:
            raise StaleAdapterError(f"server logprobs for {name} differ from the trainer's by up to {diff:.4f} "
                                    f"(tolerance {tolerance}); the served adapter is not the one just trained")
    elif previous is not None:
        _, prev_ids, prev_lp = await _sample(client, previous, messages, seed)
        changed = prev_ids != token_ids or any(abs(a - b) > 1e-5 for a, b in zip(served, prev_lp))
        metrics["publish/probe_changed"] = float(changed)
        if not changed:
            raise StaleAdapterError(f"{name} answers exactly like {previous}: the new adapter is not being served")
    return metrics
