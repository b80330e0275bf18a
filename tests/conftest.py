"""Shared pytest setup. Each area keeps its fixtures in its own `tests/fixtures_*.py` plugin."""

import os
import tempfile

# Offline, quiet, isolated: no hub downloads, no Prefect telemetry, a private Prefect home per session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="trajflow-prefect-home-"))
for _key in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
    os.environ.pop(_key, None)
# Experiment trackers stay on this machine: W&B offline, its files and Trackio's database in private folders
# (Trackio reads TRACKIO_DIR once, at import).
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="trajflow-wandb-"))
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="trajflow-trackio-"))
# the run log files and the logs of the servers a run launches (tasks/support/run_logs.py), off the home folder
os.environ.setdefault("TRAJFLOW_LOG_DIR", tempfile.mkdtemp(prefix="trajflow-logs-"))

pytest_plugins = ["tests.log_capture_lock"] + [
    f"tests.{name[:-3]}" for name in sorted(os.listdir(os.path.dirname(__file__)))
    if name.startswith("fixtures_") and name.endswith(".py")]
