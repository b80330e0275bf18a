"""Publishing: hot-load the adapter of a step into the inference server and prove it is served.

The adapter is downloaded from storage into a local cache (vLLM needs a path on its own host; the
files are checked against the hashes the training step recorded), loaded as ``<run>@<step>``, and
probed: a seeded request to ``<run>@<step>`` returns sampled tokens and their logprobs, and

- with the trainer in this process, the trainer's logprobs of exactly those tokens must agree within
  ``inference.probe_tolerance`` (max abs difference): a stale or wrong adapter is an error;
- otherwise (training on a remote GPU worker), the same request to the previous policy must give
  different logprobs unless the update left the policy unchanged (the trainer's own metric says so).

Loading is idempotent: publishing a step twice is harmless. The previous-but-one adapter is unloaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

from prefect import task

from backends.models import cache_root

from .retry_policy import TransientError, retry_condition
from .run_config import RunConfig
from .runtime import Runtime, get_runtime

log = logging.getLogger("trajflow")

PROBE_MESSAGES = [{"role": "user", "content": "Say something."}]
PROBE_USER = "trajflow-publish-probe"  # marks probe requests in server logs


class StaleAdapterError(RuntimeError):
    """The server does not answer with the adapter the trainer just wrote."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def local_adapter(rt: Runtime, step: int, expected: dict[str, str] | None) -> Path:
    """Download the adapter of `step` into the local cache, reusing a copy whose hashes match."""
    cfg = rt.config
    target = cache_root() / "adapters" / cfg.project / cfg.run / f"{step:05d}"
    if expected and target.exists() and all(
        (target / name).exists() and _sha256(target / name) == digest for name, digest in expected.items()
    ):
        return target
    rt.store.download_folder(step, "adapter", target, verify=True)
    if expected:
        for name, digest in expected.items():
            actual = _sha256(target / name)
            if actual != digest:
                raise StaleAdapterError(f"adapter file {target / name} has sha256 {actual[:12]}…, "
                                        f"the training step wrote {digest[:12]}…")
    return target


def _probe_messages(rt: Runtime, step: int) -> list[dict[str, Any]]:
    """The opening messages of this run's first stored scenario, or a fixed prompt."""
    try:
        groups = rt.store.read_groups(step, "scored.parquet") if step > 0 else []
    except Exception:  # noqa: BLE001 - any readable prompt will do
        groups = []
    for group in groups:
        for traj in group.trajectories:
            msgs = []
            for m in traj.messages():
                if m.get("role") == "assistant":
                    break
                msgs.append(m)
            if msgs:
                return msgs
    return PROBE_MESSAGES


async def _sample(client, model: str, messages, seed: int) -> tuple[list[int], list[int], list[float]]:
    resp = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0,
                                                seed=seed, logprobs=True, user=PROBE_USER)
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    prompt_ids = list(extra.get("prompt_token_ids") or (resp.model_extra or {}).get("prompt_token_ids") or [])
    token_ids = list(extra.get("token_ids") or [])
    logprobs = [e.logprob for e in (choice.logprobs.content if choice.logprobs and choice.logprobs.content else [])]
    return prompt_ids, token_ids, logprobs


async def _publish(rt: Runtime, step: int, adapter_dir: Path, trainer) -> dict[str, float]:
    cfg = rt.config
    name = cfg.policy(step)
    inference = rt.inference_client()
    try:
        await inference.load_adapter(name, str(adapter_dir))
    except Exception as exc:
        if "connect" in type(exc).__name__.lower():
            raise TransientError(f"inference server unreachable while loading {name}: {exc}") from exc
        raise
    client = rt.client()
    try:
        messages = _probe_messages(rt, step)
        prompt_ids, token_ids, served = await _sample(client, name, messages, seed=1234 + step)
        if not token_ids or len(served) != len(token_ids):
            raise StaleAdapterError(f"probe of {name} returned no token ids/logprobs; the server does not speak "
                                    "the dialect (return_token_ids + logprobs)")
        metrics: dict[str, float] = {}
        if trainer is not None:
            expected = trainer.sequence_logprobs(prompt_ids, token_ids)
            diff = max(abs(a - b) for a, b in zip(served, expected))
            metrics["publish/probe_max_abs_diff"] = diff
            if diff > cfg.inference.probe_tolerance:
                raise StaleAdapterError(
                    f"server logprobs for {name} differ from the trainer's by up to {diff:.4f} "
                    f"(tolerance {cfg.inference.probe_tolerance}); the served adapter is not the one just trained")
        elif step > 0:
            _, prev_ids, prev_lp = await _sample(client, cfg.policy(step - 1), messages, seed=1234 + step)
            n = min(len(prev_ids), len(token_ids))
            changed = prev_ids[:n] != token_ids[:n] or any(abs(a - b) > 1e-6 for a, b in zip(served, prev_lp))
            metrics["publish/probe_changed"] = float(changed)
            if not changed:
                raise StaleAdapterError(f"{name} answers exactly like {cfg.policy(step - 1)}: the new adapter "
                                        "is not being served")
    finally:
        await client.close()
    if step >= 2:
        try:
            await inference.unload_adapter(cfg.policy(step - 2))
        except Exception as exc:  # noqa: BLE001 - an old adapter that is already gone is fine
            log.debug("unload of %s skipped: %s", cfg.policy(step - 2), exc)
    return metrics


def publish_policy_fn(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Make `<run>@<step>` servable and verified; returns the served name and probe metrics."""
    rt = get_runtime(config)
    adapter_dir = local_adapter(rt, step, (training or {}).get("adapter"))
    trainer = rt.trainer_at(step) if config.training.mode == "local" else None
    metrics = asyncio.run(_publish(rt, step, adapter_dir, trainer))
    log.info("published %s %s", config.policy(step), metrics)
    return {"policy": config.policy(step), "metrics": metrics}


@task(name="publish", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_condition)
def publish_policy(config: RunConfig, step: int, training: dict[str, Any] | None) -> dict[str, Any]:
    """Not cached: a restarted server has forgotten its adapters, so publishing must run again."""
    return publish_policy_fn(config, step, training)
