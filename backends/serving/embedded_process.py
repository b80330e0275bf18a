"""The embedded inference server as a process of its own (``trajflow serve``), managed like vLLM.

In the flow's process the engine's Python (scheduling, sampling, HTTP) and the trainer's share one GIL, so overlapping
rollouts with training (the async pipeline) mostly takes turns on it. As a child process the engine has an
interpreter of its own; the flow reaches it over HTTP in the same dialect as vLLM. The command::

    EXECUTABLE... serve --model FOLDER --served-name NAME --host H --port P --device D --max-loras N
        --overlap-decode MODE --adapter-root DIR... [--engine FIELD=VALUE...] --quiet --parent-pid PID

with the API key in ``TRAJFLOW_API_KEY`` (which ``trajflow serve`` reads), never on the command line, and this code's
root at the front of ``PYTHONPATH``, so the child runs the same trajflow as its parent whatever its working folder.
``--parent-pid`` (this process) ends it when the flow's process is gone (``parent_watch.py``): a SIGKILLed flow leaves no
server holding the GPU.
Spawning, the health wait, the log, death and stopping follow `ManagedServer` (``managed_process.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.serving.managed_process import ManagedServer

API_KEY_ENV = "TRAJFLOW_API_KEY"  # what `trajflow serve` reads when --api-key is not given
CODE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding backends/, tasks/, flows/


class EmbeddedServerProcess(ManagedServer):
    """``trajflow serve`` in a child process (module docstring)."""

    label = "the embedded server"
    log_prefix = "embedded-"

    def __init__(self, executable: list[str], model: str, served_name: str, device: str, max_loras: int,
                 adapter_roots: list[str], overlap_decode: str = "auto", engine: dict | None = None,
                 host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, log_path: str | Path | None = None, startup_timeout_s: float = 600,
                 stop_grace_s: float = 30):
        super().__init__(host=host, port=port, api_key=api_key, log_path=log_path,
                         startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s)
        self.executable = list(executable)
        self.model, self.served_name, self.device = model, served_name, device
        self.max_loras, self.adapter_roots = max_loras, list(adapter_roots)
        self.overlap_decode = overlap_decode
        self.engine = dict(engine or {})

    def argv(self, port: int) -> list[str]:
        roots = [arg for root in self.adapter_roots for arg in ("--adapter-root", str(root))]
        engine = [arg for name, value in self.engine.items() for arg in ("--engine", f"{name}={_flag(value)}")]
        return [*self.executable, "serve", "--model", self.model, "--served-name", self.served_name,
                "--host", self.host, "--port", str(port), "--device", self.device,
                "--max-loras", str(self.max_loras), "--overlap-decode", self.overlap_decode, *roots, *engine,
                "--quiet", "--parent-pid", str(os.getpid())]

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        else:
            env.pop(API_KEY_ENV, None)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT), *(p for p in paths if p != str(CODE_ROOT))])
        return env

    def missing_hint(self, error: OSError) -> str:
        return f"cannot run {self.executable[0]!r} to start {self.label}: {error}"


def _flag(value) -> str:
    """A run config's YAML value as `trajflow serve --engine` reads it (booleans as true/false, None as auto)."""
    return "auto" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
