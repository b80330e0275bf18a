"""`trajflow deploy`: everything a Prefect server needs to run trajflow, set up by one idempotent command.

In order, each reported as one line (created / updated / unchanged / kept):

1. ``PREFECT_API_URL`` must name a server that answers: deployments on a temporary server would vanish with it.
2. The work pools prefect.yaml names: a missing one is created as a ``process`` pool; an existing one is kept as
   it is, whatever its type (a Kubernetes pool made by hand stays one).
3. The tag concurrency limit ``gpu`` (flows/train_step.py tags its task with it: one update per GPU): created with
   ``--gpu-slots`` when missing, kept when present (someone may have raised it for a second GPU).
4. ``prefect --no-prompt deploy --all`` on prefect.yaml, from its folder, with ``TRAJFLOW_HOME`` (the checkout's
   path on the worker hosts) defaulting to that folder: it creates or updates the deployments and replaces the
   triggers they declare (`recover/on-crash`'s: a crashed training run is run again, flows/recover.py).
5. The zombie automation (flows/automations.py): a run silent for ``silent_after_s`` after a heartbeat is marked
   Crashed. ``silent_after_s`` = 3 x the largest heartbeat interval the deployments set, or ``--silent-after-s``,
   which must be longer than that interval (shorter would crash live runs).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flows.automations import MISSED_HEARTBEATS, upsert_automation, zombie_automation
from flows.preflight import USAGE_EXIT, CommandError, check_prefect_api, run_guarded

PREFECT_YAML = Path(__file__).resolve().parents[1] / "prefect.yaml"
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
GPU_TAG = "gpu"
DEPLOY_TIMEOUT_S = 600


def read_deployments(path: Path) -> list[dict[str, Any]]:
    """The ``deployments`` of prefect.yaml at `path` (a CommandError names what is wrong with the file)."""
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}", USAGE_EXIT) from None
    except yaml.YAMLError as exc:
        raise CommandError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}", USAGE_EXIT) from None
    deployments = spec.get("deployments") if isinstance(spec, dict) else None
    if not isinstance(deployments, list) or not deployments or not all(isinstance(d, dict) for d in deployments):
        raise CommandError(f"{path} has no `deployments:` list of mappings: nothing to deploy", USAGE_EXIT)
    return deployments


def heartbeat_interval(deployment: dict[str, Any]) -> int:
    """Seconds between heartbeats of the deployment's runs: its job env's setting, else Prefect's default."""
    from prefect.settings.models.flows import FlowsSettings

    env = ((deployment.get("work_pool") or {}).get("job_variables") or {}).get("env") or {}
    raw = env.get(HEARTBEAT_ENV)
    try:
        value = FlowsSettings(heartbeat_frequency=raw) if raw is not None else FlowsSettings()
    except ValidationError as exc:
        reason = "; ".join(error["msg"] for error in exc.errors())
        raise CommandError(f"deployment {deployment.get('name')!r}: {HEARTBEAT_ENV}={raw!r} is not accepted by "
                           f"Prefect: {reason}", USAGE_EXIT) from None
    return int(value.heartbeat_frequency or 0)


def silent_after(deployments: list[dict[str, Any]], given: float | None) -> float:
    """How long a run may be silent before the zombie automation crashes it (the module's rule 5)."""
    longest = max(heartbeat_interval(d) for d in deployments)
    if given is None:
        return float(MISSED_HEARTBEATS * longest)
    if given <= longest:
        raise CommandError(f"--silent-after-s {given:g} must be longer than the longest heartbeat interval of the "
                           f"deployments ({longest} s): shorter would mark live runs Crashed", USAGE_EXIT)
    return float(given)


def ensure_work_pools(names: list[str]) -> list[str]:
    """Create the missing ones as process pools; one line per pool."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    lines = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                pool = client.read_work_pool(name)
                lines.append(f"work pool {name}: kept (type {pool.type})")
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(
                    name=name, type=ProcessWorker.type,
                    base_job_template=ProcessWorker.get_default_base_job_template()))
                lines.append(f"work pool {name}: created (type {ProcessWorker.type})")
    return lines


def ensure_gpu_limit(slots: int) -> str:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_concurrency_limit_by_tag(GPU_TAG)
            return f"concurrency limit {GPU_TAG}: kept ({limit.concurrency_limit})"
        except ObjectNotFound:
            client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)
            return f"concurrency limit {GPU_TAG}: created ({slots})"


def deploy_all(path: Path, home: str) -> list[str]:
    """`prefect --no-prompt deploy --all` on `path`; the names it deployed, or a CommandError with its output."""
    env = {**os.environ, "TRAJFLOW_HOME": home}
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(path)]
    try:
        done = subprocess.run(command, check=False, cwd=path.parent, env=env, capture_output=True, text=True,
                              timeout=DEPLOY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CommandError(f"`prefect deploy --all` did not finish within {DEPLOY_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise CommandError([f"`prefect deploy --all` failed (exit {done.returncode}):", *tail])
    return re.findall(r"Deployment '([^']+)' successfully", done.stdout)


def deploy(args: argparse.Namespace) -> int:
    if args.gpu_slots < 1:
        raise CommandError(f"--gpu-slots must be at least 1, got {args.gpu_slots}", USAGE_EXIT)
    path = Path(args.file or PREFECT_YAML).resolve()
    deployments = read_deployments(path)
    wait = silent_after(deployments, args.silent_after_s)
    home = args.home or os.environ.get("TRAJFLOW_HOME") or str(path.parent)
    if not Path(home).is_absolute():
        raise CommandError(f"TRAJFLOW_HOME must be an absolute path (the checkout on the worker hosts), got {home!r}",
                           USAGE_EXIT)
    check_prefect_api()
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise CommandError("PREFECT_API_URL is not set: deployments need a Prefect server that stays up "
                           "(prefect server start, then export PREFECT_API_URL=http://127.0.0.1:4200/api)")
    pools = sorted({(d.get("work_pool") or {}).get("name") for d in deployments} - {None})
    lines = ensure_work_pools(pools)
    lines.append(ensure_gpu_limit(args.gpu_slots))
    deployed = deploy_all(path, home)
    lines.append(f"deployments from {path} (their flows run from {home} on the workers): {', '.join(deployed)}")
    lines.append(f"automation '{zombie_automation(wait).name}' (silent for {wait:g} s -> Crashed): "
                 f"{upsert_automation(zombie_automation(wait))}")
    print("\n".join(lines))
    print("next: start the workers (prefect worker start --pool cpu-pool; on the GPU host "
          "prefect worker start --pool gpu-pool --work-queue gpu-0 --limit 1)")
    return 0


def run_command(args: argparse.Namespace) -> int:
    """`trajflow deploy`: the module's steps; a mistake is one error line, not a traceback."""
    return run_guarded("trajflow deploy", lambda: deploy(args))
