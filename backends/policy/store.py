"""A policy's life in storage, shared by the Prefect flow and the ART-style LocalBackend.

Layout inside a step folder (see storage/): ``adapter/`` (peft safetensors), ``trainer/`` (optimizer,
RNG, scheduler), ``training.json`` (metrics + adapter hashes, written last: the update is finished),
``scored.parquet`` (what was trained on). Step 0 is the seeded initial adapter (LoRA B = 0, i.e. the
base model). Publishing downloads an adapter into a local cache (checked against the recorded hashes),
hot-loads it as ``<name>@<step>`` and probes it, so a stale adapter is an error, not a silent failure.

The probe record (``training.json["probe"]``, written with every checkpoint, step 0 included, wherever the
trainer runs): prompt token ids the server itself rendered (the shortest prompt among the step's trainable
turns, else PROBE_MESSAGES through the server's chat-template code), the trainer's greedy continuation of
PROBE_TOKENS tokens and its raw logprob of each (`GRPOTrainer.greedy_continuation`), and the trainer's dtype.
The publisher, with or without a trainer in its process, asks the server (``POST /v1/completions``, token-id
prompt, temperature 0, ``ignore_eos``) to continue those ids and compares logprobs over the common prefix of
the two continuations, plus the position where they first differ (same context there: both answers are the
argmax of the same distribution, and the server's top logprobs give its logprob of the trainer's token). Greedy
argmax may flip on a near-tie in bf16; after that the contexts differ and nothing more is comparable. The
check: max |served - recorded| <= tolerance (by dtype unless configured). Without a record (runs written
before it existed): with the trainer in process, the server's greedy chat answer is scored by
``trainer.sequence_logprobs``; without, the new policy must answer differently from the previous one when
the update moved the policy (weak: a stale adapter after a small update passes).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from agents.trajectory import TrajectoryGroup
from storage.fs import sha256_local

from backends.modeling.loading import cache_root

log = logging.getLogger("trajflow")

ADAPTER = "adapter"
TRAINER_STATE = "trainer"
TRAINING_RESULT = "training.json"
SCORED = "scored.parquet"
PROBE_MESSAGES = [{"role": "user", "content": "Say something."}]
PROBE_USER = "trajflow-publish-probe"  # marks probe requests in server logs
PROBE_RECORD = "probe"  # the key of the probe record in training.json
PROBE_TOKENS = 16
PROBE_TOP_LOGPROBS = 5  # top logprobs asked of the server: its logprob of the trainer's token where they differ


class StaleAdapterError(RuntimeError):
    """The server does not answer with the adapter the trainer just wrote."""


def sha256_file(path: Path) -> str:
    return sha256_local(str(path))[0]


def save_checkpoint(store, step: int, trainer, metrics: dict[str, float],
                    probe_prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """Upload the trainer's checkpoint as step `step`, then training.json (the 'finished' mark) with the probe
    record continuing `probe_prompt_ids` (None: the rendered PROBE_MESSAGES)."""
    with tempfile.TemporaryDirectory(prefix="trajflow-ckpt-") as tmp:
        trainer.save_checkpoint(tmp)
        hashes = store.upload_folder(step, ADAPTER, Path(tmp) / ADAPTER)
        store.upload_folder(step, TRAINER_STATE, Path(tmp) / TRAINER_STATE)
    started = time.perf_counter()
    record = probe_record(trainer, probe_prompt_ids)
    metrics = {**metrics, "train/probe_record_s": time.perf_counter() - started}
    result = {"step": step, "metrics": metrics, "adapter": hashes, PROBE_RECORD: record}
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
    result = save_checkpoint(store, step, trainer, metrics, probe_prompt_ids(groups))
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


def probe_prompt_ids(groups: list[TrajectoryGroup]) -> list[int] | None:
    """The shortest prompt among the trainable turns of `groups` (ids the server rendered), or None.

    Shortest, not first: the trainer's prefill and scoring pass cost least on it, and a short prompt leaves
    room for PROBE_TOKENS more tokens in the server's context."""
    prompts = [turn.prompt_token_ids for group in groups for traj in group.trajectories if not traj.error
               for turn in traj.sampled_turns() if turn.trainable and turn.prompt_token_ids]
    return list(min(prompts, key=len)) if prompts else None


def render_probe_messages(tokenizer) -> list[int]:
    """PROBE_MESSAGES as the embedded server renders a chat request (its own code and chat template)."""
    from backends.serving.chat import ChatRequest, render_prompt

    return render_prompt(tokenizer, ChatRequest(model="probe", messages=PROBE_MESSAGES))


def dtype_name(trainer) -> str:
    return str(getattr(trainer, "dtype", "torch.float32")).removeprefix("torch.")


def probe_record(trainer, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """What the publisher checks the server against: the trainer's greedy continuation of `prompt_ids`."""
    source = "trained-turn"
    if not prompt_ids:
        prompt_ids, source = render_probe_messages(trainer.tokenizer), "probe-messages"
    tokens, logprobs = trainer.greedy_continuation(list(prompt_ids), PROBE_TOKENS)
    return {"prompt_token_ids": list(prompt_ids), "token_ids": tokens, "logprobs": logprobs,
            "dtype": dtype_name(trainer), "source": source}


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


def tolerance_for(dtype: str, configured: float | None) -> float:
    if configured is not None:
        return configured
    return AUTO_PROBE_TOLERANCE.get(dtype, AUTO_PROBE_TOLERANCE["bfloat16"])


def probe_tolerance(trainer, configured: float | None) -> float:
    return tolerance_for(dtype_name(trainer), configured)


async def _continue_ids(client, model: str, prompt_ids: list[int], max_tokens: int):
    """The server's greedy continuation of exact token ids: (token ids, raw logprobs, per-token {id: logprob})."""
    resp = await client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0, logprobs=PROBE_TOP_LOGPROBS,
        user=PROBE_USER, extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    tops = [{int(k[len("token_id:"):]): v for k, v in (top or {}).items() if k.startswith("token_id:")}
            for top in (lp.top_logprobs or [] if lp else [])]
    served = list(lp.token_logprobs or []) if lp else []
    return list((choice.model_extra or {}).get("token_ids") or []), served, tops


def compare_with_record(record: dict[str, Any], token_ids: list[int], served: list[float],
                        tops: list[dict[int, float]]) -> tuple[list[float], int]:
    """|served - recorded| over the common prefix and the first differing position; returns (diffs, prefix)."""
    expected_ids, expected = record["token_ids"], record["logprobs"]
    n = min(len(token_ids), len(served), len(expected_ids))
    same = 0
    while same < n and token_ids[same] == expected_ids[same]:
        same += 1
    diffs = [abs(served[i] - expected[i]) for i in range(min(same + 1, n))]
    if same < n and same < len(tops) and expected_ids[same] in tops[same]:
        diffs.append(abs(tops[same][expected_ids[same]] - expected[same]))
    return diffs, same


async def check_record(client, name: str, record: dict[str, Any], tolerance: float | None) -> dict[str, float]:
    """The strong publish check against a probe record (see the module docstring); StaleAdapterError if it fails."""
    token_ids, served, tops = await _continue_ids(client, name, record["prompt_token_ids"], len(record["token_ids"]))
    diffs, same = compare_with_record(record, token_ids, served, tops)
    if not diffs:
        raise StaleAdapterError(f"probe of {name} returned no token ids/logprobs; the server does not speak the "
                                "dialect (/v1/completions with token-id prompts, return_token_ids + logprobs)")
    diff, tolerance = max(diffs), tolerance_for(record.get("dtype", "bfloat16"), tolerance)
    metrics = {"publish/probe_max_abs_diff": diff, "publish/probe_mean_abs_diff": sum(diffs) / len(diffs),
               "publish/probe_tolerance": tolerance, "publish/probe_common_prefix": float(same)}
    if diff > tolerance:
        raise StaleAdapterError(f"server logprobs for {name} differ from the trainer's probe record by up to "
                                f"{diff:.4f} (tolerance {tolerance}; {same} of {len(record['token_ids'])} greedy "
                                "tokens agree); the served adapter is not the one trained at this step")
    return metrics


async def publish(inference, client, name: str, previous: str | None, adapter_dir: Path, messages,
                  seed: int, trainer=None, tolerance: float | None = None,
                  record: dict[str, Any] | None = None) -> dict[str, float]:
    """Load `adapter_dir` as `name` and prove it is served: against the probe `record` when given, else with the
    in-process `trainer`, else (weak) against `previous` (see module docstring); tolerance None: by dtype."""
    await inference.load_adapter(name, str(adapter_dir))
    if record is not None:
        return await check_record(client, name, record, tolerance)
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
