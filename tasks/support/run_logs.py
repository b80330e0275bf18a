"""A run's local log files: the flow commands' log and the logs of the inference servers the run starts.

``$TRAJFLOW_LOG_DIR/<project>/<run>.log`` (default: ``flow-logs/`` in trajflow's cache folder, ``$TRAJFLOW_CACHE`` or
``~/.cache/trajflow``) holds the commands' lines; a server the run launches (vLLM, the embedded server in its own
process) writes its output beside it, ``<run>.<server>-<replica>.log``, appended by each restart. Local files, because
a run's storage may be S3.
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.modeling.loading import cache_root

LOG_DIR_ENV = "TRAJFLOW_LOG_DIR"


def log_file_for(project: str, run: str) -> Path:
    """The run's local log file (see the module docstring)."""
    root = Path(os.environ.get(LOG_DIR_ENV) or cache_root() / "flow-logs")
    return root.expanduser() / project / f"{run}.log"


def server_log_file(project: str, run: str, server: str, replica: int) -> Path:
    """The log of replica `replica` of the run's `server` ('vllm', 'embedded'), beside the run's log file."""
    return log_file_for(project, run).with_name(f"{run}.{server}-{replica}.log")
