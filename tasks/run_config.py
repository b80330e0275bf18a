"""RunConfig: everything one training run needs, as one pydantic model.

The same model is the training flow's parameter (the Prefect UI renders it as a form), loads from YAML,
and takes ``--set key=value`` overrides on the command line (dotted keys reach nested fields; values
are parsed as YAML scalars, so ``--set steps=3`` is an int and ``--set judge=null`` is None).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agents.judge import JudgeConfig
from agents.model import policy_name
from agents.rewards import RewardConfig
from agents.tracking import TrackingConfig
from backends.modeling.devices import check_device_spelling
from backends.training.config import Switch, TrainerConfig
from backends.training.sft_config import SFTConfig
from storage.names import validate_name
from tasks.config_errors import ConfigError, describe

log = logging.getLogger("trajflow")


# engine settings that are fields of InferenceConfig itself (the vLLM launcher reads max_loras too)
OWN_ENGINE_FIELDS = {"max_loras", "overlap_decode"}


class InferenceConfig(BaseModel):
    """Where rollouts are served from."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["embedded", "vllm", "url"] = Field(
        default="embedded",
        description="`embedded`: our transformers server in the flow's process (CPU default); `vllm`: launch "
        "`vllm serve` (GPU); `url`: an already running server speaking the dialect",
    )
    url: str | None = Field(default=None, description="base URL (`…/v1`) when `backend=url`")
    embedded_process: bool = Field(
        default=False,
        description="`backend=embedded`: run the server as a process of its own (`trajflow serve`, reached over HTTP "
        "with a random key, restarted if it dies) instead of a thread of the flow's process. Worth it for the async "
        "pipeline on a GPU, where the engine's and the trainer's Python otherwise take turns on one interpreter lock; "
        "costs a second copy of the base weights and a process start (the default shares one copy with the trainer)")
    api_key_env: str = Field(default="TRAJFLOW_INFERENCE_API_KEY",
                             description="env var holding the server's API key; never put the key itself in config")
    device: str = Field(
        default="auto",
        description="device of the server we start: auto (cuda:0 if present, else cpu), cpu, cuda or cuda:K. Another "
        "GPU than training.device (e.g. cuda:0 here, cuda:1 there) keeps rollouts and the update out of each other's "
        "memory; vLLM gets it as CUDA_VISIBLE_DEVICES")
    host: str = Field(default="127.0.0.1", description="bind address of a server we start; loopback unless told")
    port: int = Field(default=0, description="port of a server we start; 0 picks a free one")
    replicas: int = Field(
        default=1, ge=1,
        description="servers we start, one per device from `device` on (cuda:0 and 2: GPUs 0 and 1); the policy client "
        "sends each rollout to one of them (the least busy; all turns of a rollout to the same one) and each publish "
        "loads and probes the adapter on every one. More replicas shorten rollouts, not the update")
    max_loras: int = Field(default=4, description="adapters resident at once; more costs memory, fewer costs reloads")
    overlap_decode: Switch = Field(
        default="auto",
        description="embedded server: launch each decode step before the host accepts the previous one's tokens "
        "(the engine's `overlap_decode`). auto: on where decode steps are CUDA graphs, off on the CPU; `off` is the "
        "serial loop, the way back should the overlapped one misbehave on a device")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="embedded server: further engine settings by name (`EngineConfig` in "
        "backends/inference/engine_config.py; `trajflow serve --engine`), e.g. `{compile_decode: true, "
        "admission_wait_steps: 8}`; checked when the config is read. max_loras and overlap_decode are the fields above")
    gpu_memory_utilization: float = Field(default=0.6, description="vLLM: share of GPU memory it may take")
    max_model_len: int = Field(default=4096, description="vLLM: context length; bounds KV cache size")
    tool_call_parser: str = Field(default="hermes", description="vLLM: tool-call parser matching the chat template")
    max_lora_rank: int = Field(default=16, description="vLLM: largest LoRA rank it must accept")
    vllm_command: list[str] | str = Field(
        default_factory=lambda: ["vllm"],
        description="vLLM: the argv that runs its CLI before `serve` (a string is split like a shell would). The "
        "default `vllm` from PATH runs in the flow's environment, which pip cannot share with vLLM 0.26 (fastapi "
        "pins); name vLLM's own environment instead, e.g. `[/opt/vllm-env/bin/vllm]` or `[python3, -m, "
        "vllm.entrypoints.cli.main]` with `vllm_env: {PYTHONPATH: /opt/vllm-site}`, at the cost of a second "
        "install to keep in step",
    )
    vllm_env: list[str] | dict[str, str | None] = Field(
        default_factory=dict,
        description="vLLM: environment over the flow's. A mapping sets values (null removes a variable, e.g. the "
        "flow's PYTHONPATH); a list names variables that must be set in the flow's environment (credentials: their "
        "values stay out of the config, and names that look secret are never logged)",
    )

    @field_validator("device")
    @classmethod
    def _device_spelling(cls, value: str) -> str:
        return check_device_spelling(value)

    @model_validator(mode="after")
    def _replicas_are_ours(self) -> InferenceConfig:
        if self.replicas > 1 and self.backend == "url":
            raise ValueError(f"replicas={self.replicas} needs servers the run starts (backend embedded or vllm); "
                             "backend=url attaches to one server")
        if self.embedded_process and self.backend != "embedded":
            raise ValueError(f"embedded_process=true applies to backend=embedded; backend={self.backend} "
                             + ("already runs as a process of its own" if self.backend == "vllm"
                                else "attaches to a server started elsewhere"))
        return self

    @field_validator("engine")
    @classmethod
    def _engine_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        from backends.inference.engine_config import EngineConfig

        own = OWN_ENGINE_FIELDS & set(value)
        if own:
            raise ValueError(f"{', '.join(sorted(own))}: set inference.{sorted(own)[0]} instead of inside engine")
        unknown = sorted(set(value) - set(EngineConfig.model_fields))
        if unknown:
            raise ValueError(f"no engine setting {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(set(EngineConfig.model_fields) - OWN_ENGINE_FIELDS))}")
        EngineConfig(**value)  # a bad value fails here, named by pydantic, not when the server starts
        return value

    @field_validator("vllm_command")
    @classmethod
    def _vllm_argv(cls, value: list[str] | str) -> list[str]:
        from backends.serving.vllm import command_argv

        return command_argv(value)

    probe_tolerance: float | None = Field(
        default=None, gt=0,
        description="publish check: a flat tolerance on every probe token's |server logprob - trainer logprob|; "
        "larger tolerates bf16 noise, smaller catches subtler stale adapters. None: the rule by the trainer's dtype "
        "(`backends/policy/probe_rule.py`: each token within base + 2 (1 - p) delta, the median within base; float32 "
        "0.05 flat, bfloat16 base 0.125, delta 0.5)",
    )


class RolloutConfig(BaseModel):
    """How rollouts are run inside the rollout task."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(default=32, ge=1, description="rollouts in flight at once; higher fills the server's batches")
    timeout_s: float = Field(default=300.0, gt=0, description="a rollout running longer is recorded as a failure")
    max_failure_fraction: float = Field(
        default=0.5, ge=0, le=1, description="the task fails when more than this share of rollouts fail"
    )


class PipelineConfig(BaseModel):
    """Whether rollouts of later steps overlap the training of the current one (backends/policy/staleness.py)."""

    model_config = ConfigDict(extra="forbid")

    max_off_policy_steps: int = Field(
        default=0, ge=0,
        description="k: step s trains on rollouts sampled by policy step s-1-k (the stalest the bound allows), so "
        "they run while earlier steps train. 0 is the synchronous loop (sample, train, publish, in turn); 1 keeps "
        "the inference server busy while the trainer works, at the cost of learning from one-step-old samples "
        "(corrected by the loss's importance ratio); more hides longer training but learns from staler samples and "
        "keeps k+2 adapters served and k+1 checkpoints retained",
    )


class RetentionConfig(BaseModel):
    """Which checkpoints survive; trajectories and metrics are always kept."""

    model_config = ConfigDict(extra="forbid")

    keep_last: int = Field(default=3, ge=1, description="newest committed steps whose adapters are kept")
    best_metric: str | None = Field(default="val/reward", description="also keep the best step by this metric")
    mode: Literal["max", "min"] = Field(default="max", description="whether larger or smaller best_metric is better")


class TrainingPlacement(BaseModel):
    """Where the GRPO update runs."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "local", "process", "deployment"] = Field(
        default="auto",
        description="`auto`: `process` when rollouts run beside the update (pipeline.max_off_policy_steps >= 1) on one "
        "GPU, else `local`; `local`: in the flow's process on its device; `process`: in a child process of the flow that "
        "keeps the trainer between steps (its own GIL: with pipeline.max_off_policy_steps >= 1 the rollouts running "
        "meanwhile do not slow the update; a trainer that runs out of memory fails the step, not the flow); "
        "`deployment`: run `flows/train_step.py` as a Prefect deployment on a GPU work pool (inputs and outputs "
        "through storage)",
    )
    deployment: str = Field(default="train-step/gpu",
                            description="`<flow>/<deployment>` name used when `mode=deployment`")
    device: str = Field(
        default="auto",
        description="training device: auto, cpu, cuda or cuda:K. With gpus N > 1, the first of N consecutive GPUs "
        "(cuda:1 and gpus 3: GPUs 1, 2, 3), or N processes on the CPU (gloo; for tests, never faster). Another GPU "
        "than inference.device keeps rollouts and the update out of each other's memory")
    gpus: int = Field(
        default=1, ge=1,
        description="processes (GPUs) of the GRPO update: N > 1 runs it data-parallel under torchrun (rows split by "
        "tokens, LoRA gradients summed; the same update as one process up to rounding), in either mode. More GPUs "
        "shorten the update, not the rollouts")
    timeout_s: float = Field(default=3600.0, description="how long to wait for a remote training run")

    @field_validator("device")
    @classmethod
    def _device_spelling(cls, value: str) -> str:
        return check_device_spelling(value)


class SFTStage(SFTConfig):
    """Step 0 as a supervised warm start: the LoRA adapter trained on demonstrations before the GRPO steps."""

    data: str = Field(
        description="demonstrations, JSONL, one OpenAI chat-format conversation per line ({messages, tools?, "
        "metadata?}): a local path, file://PATH or s3://BUCKET/KEY (read through the storage layer, with its "
        "credentials). Web URLs are not fetched. Its content hash is part of the run: another file on resume is "
        "refused")

    @field_validator("data")
    @classmethod
    def _local_or_storage(cls, value: str) -> str:
        scheme = value.split("://", 1)[0].lower() if "://" in value else None
        if scheme in ("http", "https"):
            raise ValueError(f"{value!r} is a web URL, and trajflow fetches no URL a config names (security rule); "
                             "download it and give a local path, or put it in storage: file://PATH or s3://BUCKET/KEY")
        if scheme not in (None, "file", "s3", "s3a"):
            raise ValueError(f"{value!r}: scheme {scheme!r} is not supported; give a local path, file://PATH or "
                             "s3://BUCKET/KEY")
        if not value.strip():
            raise ValueError("give the demonstrations file (a local path, file://PATH or s3://BUCKET/KEY)")
        return value

    def settings(self) -> SFTConfig:
        """The training settings, without where the data is."""
        return SFTConfig(**self.model_dump(exclude={"data"}))


class RunConfig(BaseModel):
    """One training run: agent, model, storage and schedule first, then the trainer, then the internals."""

    model_config = ConfigDict(extra="forbid")

    # Declaration order is the order of the Prefect UI's form: the knobs most runs change come first, the sections
    # few people open (rollout concurrency, serving, placement, retention) last.
    agent: str = Field(default="arithmetic",
                       description="agent name from `agents/registry.py`, or `module:attr` for your own")
    base_model: str = Field(default="smollm2-135m",
                            description="`smollm2-135m`, `tiny-random` or a local Hugging Face model folder")
    storage: str = Field(default="runs", description="storage root: a local folder, a `file://` or an `s3://` URL")
    run: str = Field(default="default", description="run name; also the served policy name `<run>@<step>`")
    steps: int = Field(default=5, ge=0, description="train until this many steps are committed (step 0 is the "
                       "untrained policy)")
    group_size: int = Field(default=4, ge=1, description="rollouts per scenario (the GRPO group); larger = better baseline")
    groups_per_step: int = Field(default=4, ge=1, description="scenarios per step; more = less noisy gradient, slower step")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig,
                                   description="GRPO trainer settings, the learning rate first")
    sft: SFTStage | None = Field(default=None, description="supervised warm start: step 0 is the adapter trained on "
                                 "these demonstrations (then GRPO continues from it); None: step 0 is the base model")
    eval_every: int = Field(default=0, ge=0, description="evaluate on validation scenarios every k steps; 0 = never")
    eval_scenarios: int = Field(default=16, ge=1, description="validation scenarios per evaluation")
    eval_at_start: bool = Field(default=False, description="also evaluate the base policy before the first step")
    project: str = Field(default="trajflow", description="groups runs in storage: `<storage>/<project>/<run>`")
    seed: int = Field(default=0, description="seeds scenario order, LoRA init and every rollout's sampling")
    agent_options: dict[str, Any] = Field(default_factory=dict, description="keyword options for the agent")
    max_tokens: int | None = Field(default=None, description="default max_tokens per completion when the agent sets none")
    rewards: RewardConfig = Field(default_factory=RewardConfig,
                                  description="reward component weights and how a judge score combines with them")
    judge: JudgeConfig | None = Field(default=None, description="LLM judge that ranks each group; None = agent reward only")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="rollouts of later steps overlapping training (async, off-policy)")
    rollouts: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout concurrency, timeouts, failures")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="rollout server")
    training: TrainingPlacement = Field(default_factory=TrainingPlacement, description="where training runs")
    retention: RetentionConfig = Field(default_factory=RetentionConfig, description="checkpoint retention")
    tracking: TrackingConfig | None = Field(default=None, description="experiment trackers (W&B, Trackio, Weave); "
                                            "None: none")

    # What a run IS: continuing a stored run under other values would mix two experiments under one name. Of the
    # trainer, only TrainerConfig.IDENTITY_FIELDS count (see check_run_identity).
    # Of sft, its SFTConfig.identity() settings count; the data file's content is checked by its hash
    # (tasks/sft.py), so the same demonstrations may move to another path.
    IDENTITY_FIELDS: ClassVar[tuple[str, ...]] = ("agent", "agent_options", "base_model", "seed", "group_size",
                                                  "groups_per_step", "sft", "trainer")

    @field_validator("project", "run")
    @classmethod
    def _safe_names(cls, v: str, info) -> str:
        return validate_name(info.field_name, v)

    @model_validator(mode="after")
    def _pipeline_keeps_its_policies(self) -> RunConfig:
        k = self.pipeline.max_off_policy_steps
        if self.retention.keep_last < k + 1:
            # a resumed run samples step s+1..s+k with the policies of steps s-k..s: their adapters must survive
            raise ValueError(f"retention.keep_last={self.retention.keep_last} is too few for "
                             f"pipeline.max_off_policy_steps={k}: a resumed run needs the last {k + 1} checkpoints")
        return self

    def policy(self, step: int) -> str:
        """The served name of the policy after `step` updates."""
        return policy_name(self.run, step)


def _differs(stored: Any, current: Any) -> bool:
    """Stored vs current setting; a field the stored config lacks (added by a newer version) is no change."""
    if isinstance(stored, dict) and isinstance(current, dict):
        return any(_differs(v, current.get(k)) for k, v in stored.items() if k in current)
    return stored != current


def _sft_identity(sft: dict[str, Any] | None) -> dict[str, Any] | None:
    """The part of a stored or current ``sft`` section that defines the run (SFTStage's data path aside)."""
    if sft is None:
        return None
    return {k: v for k, v in sft.items() if k != "data" and k not in SFTConfig.NON_IDENTITY_FIELDS}


def check_run_identity(stored: dict[str, Any] | None, config: RunConfig) -> None:
    """Refuse to continue a run whose ``RunConfig.IDENTITY_FIELDS`` changed; other trainer changes are logged.

    Of the trainer, only ``TrainerConfig.IDENTITY_FIELDS`` (the adapter's shape, its seed and dropout) define the
    run: a run may go on with a new learning rate, loss or batching, e.g. on another machine.
    """
    if not stored:
        return
    identity = TrainerConfig.IDENTITY_FIELDS
    current = config.model_dump(mode="json")
    stored_trainer, current_trainer = stored.get("trainer") or {}, current["trainer"]
    tuned = [f"{k}: {v!r} -> {current_trainer[k]!r}" for k, v in stored_trainer.items()
             if k in current_trainer and k not in identity and _differs(v, current_trainer[k])]
    if tuned:
        log.warning("run %s/%s continues with changed trainer settings: %s", config.project, config.run,
                    "; ".join(tuned))
    stored, current = dict(stored), dict(current)
    if "sft" in stored:
        stored["sft"], current["sft"] = _sft_identity(stored["sft"]), _sft_identity(current["sft"])
    changed = [f for f in RunConfig.IDENTITY_FIELDS
               if f != "trainer" and f in stored and _differs(stored[f], current.get(f))]
    if TrainerConfig.identity_changes(stored_trainer, current_trainer):
        changed.append("trainer")  # last in IDENTITY_FIELDS, so the message keeps their order
    if changed:
        raise ValueError(
            f"run {config.project}/{config.run} already exists in {config.storage} with different {', '.join(changed)}; "
            "use a new run name (--set run=...) or the original settings")


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValueError(f"--set {dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings (values parsed as YAML) to a config dict."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {key}: the value {raw!r} is not valid YAML ({exc.problem}); quote it "
                             f"to pass a string: --set {key}='\"...\"'") from None
        _set_dotted(data, key, value)
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML RunConfig (or defaults when path is None) and apply overrides.

    Every mistake raises ConfigError with one line per problem (tasks/config_errors.py): a missing or unreadable
    file, bad YAML, a malformed --set, an unknown key (with the key meant), a value out of range.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError([f"config file not found: {path}"]) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError([f"cannot read config file {path}: {exc.strerror or exc}"
                               if isinstance(exc, OSError) else f"{path}: not a text file"]) from None
        except yaml.YAMLError as exc:
            raise ConfigError([f"{path}: not valid YAML: {' '.join(str(exc).split())}"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{path}: expected a mapping of RunConfig fields, got {type(loaded).__name__}"])
        data = loaded or {}
    try:
        apply_overrides(data, overrides or [])
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(RunConfig, exc)) from None
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
