"""vLLM as a managed subprocess speaking our inference dialect (or an already-running vLLM, attached by URL).

`build_command` turns a `VLLMConfig` into::

    COMMAND... serve MODEL --host H --port P --served-model-name NAME
        --enable-lora --max-lora-rank R --max-loras N [--max-cpu-loras M]
        --enable-auto-tool-choice --tool-call-parser hermes
        --logprobs-mode raw_logprobs --gpu-memory-utilization F [--max-model-len L] [--dtype D] EXTRA...

where COMMAND is ``vllm`` or any argv that runs vLLM's CLI (``/opt/vllm-env/bin/vllm``, ``python3 -m
vllm.entrypoints.cli.main``), with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (so ``/v1/load_lora_adapter`` works) over
the caller's environment plus `VLLMConfig.env` (a None value removes a variable, e.g. the flow's ``PYTHONPATH``). The API key goes in the
``VLLM_API_KEY`` environment variable, which vLLM reads like ``--api-key``, so it never shows in ``ps`` or in our
logs. Token ids come back per request: callers send ``extra_body={"return_token_ids": True}`` (the embedded server
returns them always). `VLLMServer.start` waits for ``/health`` up to a deadline and, if vLLM exits or the deadline
passes, raises `VLLMStartError` with the tail of vLLM's log; `stop` sends SIGTERM to vLLM's process group, then
SIGKILL after a grace period. vLLM cannot run on the CPU-only machines this project is tested on: the tests run
the launcher against a fake ``vllm`` executable and the dialect client against the embedded server.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.serving.inference_client import InferenceClient

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Environment variables whose values are never logged: their names say they hold a credential.
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)

log = logging.getLogger("trajflow")


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


class VLLMStartError(RuntimeError):
    """vLLM exited or did not become healthy in time; the message ends with the tail of its log."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def log_tail(path: Path, lines: int = 40, secret: str | None = None) -> str:
    """Last `lines` lines of a log file, with `secret` masked."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e})"
    tail = "\n".join(text.splitlines()[-lines:])
    return tail.replace(secret, "***") if secret else tail


class VLLMServer:
    """A vLLM server we launched (`start`/`stop`) or one already running (`attach`)."""

    def __init__(self, config: VLLMConfig):
        self.config = config
        self.port = config.port
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = Path(config.log_path) if config.log_path else None
        self._url: str | None = None

    @classmethod
    def attach(cls, url: str, api_key: str | None = None) -> "VLLMServer":
        """A handle on a server started elsewhere (`url` with or without /v1); `stop` leaves it running."""
        server = cls(VLLMConfig(model="(attached)", api_key=api_key))
        root = url.rstrip("/")
        server._url = root[: -len("/v1")] if root.endswith("/v1") else root
        return server

    @property
    def url(self) -> str:
        if self._url is not None:
            return self._url
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, timeout: float = 60) -> InferenceClient:
        return InferenceClient(self.base_url, api_key=self.config.api_key, timeout=timeout)

    def start(self, wait: bool = True) -> "VLLMServer":
        """Launch vLLM; with `wait`, return once /health answers (VLLMStartError with its log tail otherwise)."""
        if self.process is not None:
            raise RuntimeError("this VLLMServer was already started")
        cfg = self.config
        self.port = cfg.port or _free_port(cfg.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = vllm_environment(cfg, dict(os.environ))
        argv = build_command(cfg, self.port)
        log.info("starting vLLM: %s (env: %s; log: %s)", shlex.join(argv),
                 describe_env({RUNTIME_LORA_ENV: "True", **cfg.env}), self.log_path)
        out = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as e:
            raise VLLMStartError(f"cannot run {shlex.join(cfg.executable)!r}: {e} (is vLLM installed? set "
                                 "inference.vllm_command to its executable, or pip install 'trajflow[vllm]')") from e
        finally:
            out.close()
        if wait:
            self.wait_healthy(cfg.startup_timeout_s)
        return self

    def wait_healthy(self, deadline_s: float) -> None:
        """Poll /health; raise VLLMStartError (and stop the process) if it exits or the deadline passes."""
        client = self.client(timeout=5)
        end = time.monotonic() + deadline_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise VLLMStartError(f"vLLM exited with code {code} before becoming healthy; last log lines "
                                     f"({self.log_path}):\n{self._tail()}")
            if client.health_sync():
                return
            if time.monotonic() >= end:
                self.stop()
                raise VLLMStartError(f"vLLM did not answer {self.url}/health within {deadline_s} s; last log "
                                     f"lines ({self.log_path}):\n{self._tail()}")
            time.sleep(0.25)

    def failure(self) -> str | None:
        """None while the vLLM we launched runs (or for an attached one); once it has exited, a message naming its
        pid, exit code and log tail."""
        proc = self.process
        if proc is None or proc.poll() is None:
            return None
        return (f"vLLM (pid {proc.pid}, {self.url}) exited with code {proc.returncode}; last log lines "
                f"({self.log_path}):\n{self._tail()}")

    def _tail(self) -> str:
        return log_tail(self.log_path, secret=self.config.api_key) if self.log_path else "(no log)"

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM vLLM's process group, SIGKILL after `grace_s` (default: the config's); returns the exit code
        (None if attached)."""
        grace_s = self.config.stop_grace_s if grace_s is None else grace_s
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        return proc.returncode

    def __enter__(self) -> "VLLMServer":
        return self if self.process is not None or self._url is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
