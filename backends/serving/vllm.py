"""vLLM as a managed subprocess speaking our inference dialect (or an already-running vLLM, attached by URL).

`build_command` turns a `VLLMConfig` into::

    COMMAND... serve MODEL --host H --port P --served-model-name NAME
        --enable-lora --max-lora-rank R --max-loras N [--max-cpu-loras M]
        --enable-auto-tool-choice --tool-call-parser hermes
        --logprobs-mode raw_logprobs --gpu-memory-utilization F [--max-model-len L] [--dtype D]
        [--chat-template FILE] EXTRA...

where COMMAND is ``vllm`` or any argv that runs vLLM's CLI (``/opt/vllm-env/bin/vllm``, ``python3 -m
vllm.entrypoints.cli.main``), with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (so ``/v1/load_lora_adapter`` works) over
the caller's environment plus `VLLMConfig.env` (a None value removes a variable, e.g. the flow's ``PYTHONPATH``). The API key goes in the
``VLLM_API_KEY`` environment variable, which vLLM reads like ``--api-key``, so it never shows in ``ps`` or in our
logs. Token ids come back per request: callers send ``extra_body={"return_token_ids": True}`` (the embedded server
returns them always). Starting, the health wait (`VLLMStartError` with the tail of vLLM's log), noticing its death and
stopping it are `ManagedServer`'s (`backends/serving/managed_process.py`), shared with the embedded server run as a
process of its own. vLLM cannot run on the CPU-only machines this project is tested on: the tests run
the launcher against a fake ``vllm`` executable and the dialect client against the embedded server.
"""

from __future__ import annotations

import re
import shlex

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.serving.managed_process import ManagedServer, ServerStartError, log_tail  # noqa: F401 - log_tail: API

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Environment variables whose values are never logged: their names say they hold a credential.
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)


def command_argv(command: str | list[str]) -> list[str]:
    """An executable given as argv (kept) or as one string (split the way a POSIX shell splits words)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"the vLLM command must name an executable, got {command!r}")
    return argv


class VLLMConfig(BaseModel):
    """How to launch `vllm serve` for trajflow."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Base model: a local folder or a model id vLLM can load on its host.")
    served_model_name: str | None = Field(None, description=(
        "Name the base model is served under (default: `model`); adapters are addressed as '<name>@<step>'."))
    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 exposes it to the network.")
    port: int = Field(8000, ge=0, le=65535, description="Port; 0 picks a free one.")
    api_key: str | None = Field(None, repr=False, description=(
        "Key every request must send as 'Authorization: Bearer <key>' (passed to vLLM in VLLM_API_KEY)."))
    max_lora_rank: int = Field(64, description="Largest adapter rank (vLLM allows 1, 8, 16, 32, 64, 128, 256, ...).")
    max_loras: int = Field(4, ge=1, description="Adapters one batch can mix (GPU slots); more costs GPU memory.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters cached in host memory (default: max_loras).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description=(
        "Share of GPU memory vLLM takes (weights + KV cache). Lower it when the trainer shares the GPU."))
    max_model_len: int | None = Field(None, ge=16, description="Context length; smaller saves KV memory.")
    tool_call_parser: str = Field("hermes", description=(
        "vLLM's tool-call parser; 'hermes' reads <tool_call>{json}</tool_call> as Qwen2.5 and our templates emit."))
    dtype: str | None = Field(None, description="Model dtype ('auto', 'bfloat16', ...); default vLLM's choice.")
    chat_template: str | None = Field(None, description=(
        "A chat template file vLLM renders chats with instead of the model's (`--chat-template`); a flag of the same "
        "name in extra_args wins. The flow sets it where the model's template ignores tools (SmolLM2's ChatML): "
        "the embedded server then renders tools with TOOL_CHAT_TEMPLATE, and vLLM must too."))
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments, appended as is.")
    executable: list[str] = Field(["vllm"], description=(
        "The argv that runs vLLM's CLI, before 'serve' (a string is split like a shell would): 'vllm' on PATH, "
        "a path, or e.g. ['python3', '-m', 'vllm.entrypoints.cli.main']."))
    env: dict[str, str | None] = Field(default_factory=dict, description=(
        "Environment variables for vLLM over the caller's; None removes one (e.g. the flow's PYTHONPATH)."))
    startup_timeout_s: float = Field(900, gt=0, description="How long to wait for /health (model load, compile).")
    stop_grace_s: float = Field(30, gt=0, description="Seconds between SIGTERM and SIGKILL when stopping vLLM.")
    log_path: str | None = Field(None, description="File for vLLM's stdout/stderr (default: a temporary file).")


    @field_validator("executable", mode="before")
    @classmethod
    def _argv(cls, value):
        return command_argv(value)


class VLLMStartError(ServerStartError):
    """vLLM exited or did not become healthy in time; the message ends with the tail of its log."""


def build_command(cfg: VLLMConfig, port: int) -> list[str]:
    """The argv of `vllm serve` for `cfg` on `port`."""
    cmd = [*cfg.executable, "serve", cfg.model, "--host", cfg.host, "--port", str(port),
           "--served-model-name", cfg.served_model_name or cfg.model,
           "--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras),
           "--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser,
           "--logprobs-mode", "raw_logprobs",
           "--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.max_cpu_loras is not None:
        cmd += ["--max-cpu-loras", str(cfg.max_cpu_loras)]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.dtype is not None:
        cmd += ["--dtype", cfg.dtype]
    if cfg.chat_template is not None and not any(a.split("=")[0] == "--chat-template" for a in cfg.extra_args):
        cmd += ["--chat-template", cfg.chat_template]
    return cmd + list(cfg.extra_args)


def vllm_environment(cfg: VLLMConfig, base: dict[str, str]) -> dict[str, str]:
    """vLLM's environment: `base`, then `cfg.env` (None removes), then the runtime-LoRA switch and the API key."""
    env = {**base, RUNTIME_LORA_ENV: "True"}
    for name, value in cfg.env.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env[RUNTIME_LORA_ENV] = "True"
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key
    else:
        env.pop("VLLM_API_KEY", None)
    return env


def describe_env(env: dict[str, str | None]) -> str:
    """``NAME=value`` pairs for a log line, with the value of a credential-like name shown as ***."""
    def shown(name: str, value: str | None) -> str:
        return "(removed)" if value is None else "***" if SECRET_NAME.search(name) else value
    return " ".join(f"{name}={shown(name, value)}" for name, value in env.items())


class VLLMServer(ManagedServer):
    """A vLLM server we launched (`start`/`stop`) or one already running (`attach`); the process rules are
    `ManagedServer`'s (`backends/serving/managed_process.py`)."""

    label = "vLLM"
    start_error = VLLMStartError
    log_prefix = "vllm-"

    def __init__(self, config: VLLMConfig, url: str | None = None):
        super().__init__(host=config.host, port=config.port, api_key=config.api_key, log_path=config.log_path,
                         startup_timeout_s=config.startup_timeout_s, stop_grace_s=config.stop_grace_s, url=url)
        self.config = config

    @classmethod
    def attach(cls, url: str, api_key: str | None = None) -> VLLMServer:
        """A handle on a server started elsewhere (`url` with or without /v1); `stop` leaves it running."""
        return cls(VLLMConfig(model="(attached)", api_key=api_key), url=url)

    def argv(self, port: int) -> list[str]:
        return build_command(self.config, port)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        return vllm_environment(self.config, base)

    def describe_start(self, argv: list[str]) -> str:
        return (f"starting vLLM: {shlex.join(argv)} (env: {describe_env({RUNTIME_LORA_ENV: 'True', **self.config.env})}"
                f"; log: {self.log_path})")

    def missing_hint(self, error: OSError) -> str:
        return (f"cannot run {shlex.join(self.config.executable)!r}: {error} (is vLLM installed? set "
                "inference.vllm_command to its executable, or pip install 'trajflow[vllm]')")
