"""A run's embedded server as a process of its own (``inference.embedded_process``): RunConfig turned into the
launcher's `EmbeddedServerProcess`.

- The command: ``python -m flows.cli serve`` with this interpreter, so the child has the flow's packages.
- The base model: resolved here, as for vLLM (`vllm_launch.py`): the child gets the local folder and serves it under
  the name the in-process engine would use, and an unknown model fails here in one line, before anything starts.
- The device: `device` as placed (``tasks/support/placement.py``), passed as ``--device`` (``cpu`` or ``cuda:K``).
- Adapters: the run's adapter cache (``backends.policy.publish.adapter_cache``), where publishing downloads each step,
  is the child's ``--adapter-root``.
- The key: the runtime's (``inference.api_key_env``, or a random one it made), given in the child's environment.
- The log: ``<run>.embedded-<replica>.log`` beside the run's log file (``tasks/support/run_logs.py``).
"""

from __future__ import annotations

import sys

from backends.modeling.loading import resolve_model
from backends.policy.publish import adapter_cache
from backends.serving.embedded_process import EmbeddedServerProcess
from tasks.run_config import RunConfig
from tasks.support.run_logs import server_log_file

SERVE_COMMAND = [sys.executable, "-m", "flows.cli"]  # before `serve`: the `trajflow` command of this interpreter


def embedded_process(config: RunConfig, api_key: str | None, device: str, port: int,
                     replica: int = 0) -> EmbeddedServerProcess:
    """The launcher for replica `replica` of this run's embedded server on `device`, `port` (0: a free one)."""
    inf = config.inference
    spec = resolve_model(config.base_model)
    return EmbeddedServerProcess(
        SERVE_COMMAND, model=str(spec.path), served_name=spec.name, device=device, max_loras=inf.max_loras,
        overlap_decode=inf.overlap_decode, engine=inf.engine,
        adapter_roots=[str(adapter_cache(config.project, config.run))],
        host=inf.host, port=port, api_key=api_key,
        log_path=server_log_file(config.project, config.run, "embedded", replica))
