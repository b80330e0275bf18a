"""ART's current script style on tiny-random, CPU: `iterate_dataset`, `backend.train(model, groups,
learning_rate=...)`, `model.log(val_trajectories, split="val")`, tracked in W&B (offline) and Trackio.

One process trains two steps; a new process resumes at step 2, trains step 3, and forks a second model from step 1
with `_experimental_fork_checkpoint`, which then trains on the batch the first model took after step 1. The same
script runs against LocalBackend and, as a client, against `trajflow backend serve` (RemoteBackend). Afterwards: the
stored steps, the fork's provenance, one W&B run and one Trackio run per trajflow run with every step at x = step,
and the W&B key nowhere in storage, tracker files or output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from storage.store import RunStore
from tests.fixtures_tracking import trackio_logs, trackio_runs, wandb_offline_runs
from tests.integration.test_art_api import ROLLOUT, _free_port, run_script
from tests.paths import REPO

WANDB_KEY = "wandb-secret-key-0123456789abcdef0123"
BACKEND_KEY = "k-current-api-123"

SCRIPT = '''
import asyncio, json, os, sys
from agents import TrainableModel, Trajectory, TrajectoryGroup, gather_trajectory_groups, iterate_dataset
from backends import LocalBackend, RemoteBackend

where, num_steps = sys.argv[1], int(sys.argv[2])
scenarios = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to 3."]
''' + ROLLOUT + '''
async def train_until(model, backend, last_step, label):
    start = await model.get_step()
    print(json.dumps({"model": label, "start": start}))
    for batch in iterate_dataset(scenarios, groups_per_step=2, num_epochs=4, initial_step=start, use_tqdm=False):
        if batch.step >= last_step:
            break
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, s) for _ in range(3)) for s in batch.items), pbar_desc=None)
        result = await backend.train(model, groups, learning_rate=1e-5)
        val = [await rollout(model, s) for s in scenarios[:2]]
        await model.log(val, split="val")
        print(json.dumps({"model": label, "trained": result.step, "batch": batch.step, "items": batch.items,
                          "checkpoint": result.checkpoint_path}))

async def main():
    tracking = {"wandb": {"mode": "offline"}, "trackio": {"project": os.environ["TRACKIO_PROJECT"]}}
    backend = (RemoteBackend(where, api_key=os.environ["BACKEND_KEY"]) if where.startswith("http")
               else LocalBackend(storage=where))
    model = TrainableModel(name="agent-001", project="my-agent", base_model="tiny-random", tracking=tracking)
    await model.register(backend)
    await train_until(model, backend, num_steps, "agent-001")
    if num_steps == 3:
        fork = TrainableModel(name="agent-fork", project="my-agent", base_model="tiny-random")
        await backend._experimental_fork_checkpoint(fork, from_model="agent-001", not_after_step=1)
        await fork.register(backend)
        await train_until(fork, backend, await fork.get_step() + 1, "agent-fork")
    result = backend.close()
    if result is not None:
        await result

asyncio.run(main())
'''


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _run_current_style(fork_launcher, where: str, tmp_path: Path, env: dict) -> list[list[dict]]:
    script = tmp_path / "current.py"
    script.write_text(SCRIPT)
    runs = []
    for num_steps in (2, 3):  # two steps, then a new process that resumes at step 2 and forks from step 1
        code, out, err = run_script(fork_launcher, [str(script), where, str(num_steps)], env, REPO, tmp_path)
        assert code == 0, err[-3000:]
        assert WANDB_KEY not in out + err
        runs.append(_events(out))
    return runs


def _check(runs: list[list[dict]], storage: str, tmp_path: Path, trackio_project: str) -> None:
    first, second = runs
    assert first[0] == {"model": "agent-001", "start": 0}
    assert [(e["trained"], e["batch"]) for e in first[1:]] == [(1, 0), (2, 1)]
    assert second[0] == {"model": "agent-001", "start": 2} and (second[1]["trained"], second[1]["batch"]) == (3, 2)
    # the fork starts at step 1 and trains on the batch the source took after step 1: the data cursor came along
    assert second[2] == {"model": "agent-fork", "start": 1}
    assert (second[3]["trained"], second[3]["batch"], second[3]["items"]) == (2, 1, first[2]["items"])
    assert second[3]["checkpoint"].endswith("my-agent/agent-fork/steps/00002/adapter")

    source, fork = RunStore(storage, "my-agent", "agent-001"), RunStore(storage, "my-agent", "agent-fork")
    assert source.committed_steps() == [0, 1, 2, 3] and fork.committed_steps() == [1, 2]
    assert fork.read_run_config()["forked_from"]["run"] == "agent-001"
    assert fork.read_run_config()["forked_from"]["step"] == 1
    copied, original = fork.read_manifest(1).files, source.read_manifest(1).files
    assert {rel: copied[rel] for rel in original} == original  # the same bytes (and the trajectories logged since)
    assert "val/reward" in source.read_manifest(3).metrics and source.exists(3, "logs/val.parquet")

    wandb_runs = wandb_offline_runs(tmp_path / "wandb")
    assert len(wandb_runs) == 2 and len({r.run_id for r in wandb_runs}) == 1  # resumed, not duplicated
    assert wandb_runs[0].name == "agent-001" and wandb_runs[0].config["base_model"] == "tiny-random"
    rows = [row for r in wandb_runs for row in r.history]
    assert [row["step"] for row in rows if "train/reward" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "val/reward" in row] == [1, 2, 3]
    assert all(row["trajectories/nrows"] == 4 for row in rows if "train/reward" in row)
    assert trackio_runs(trackio_project) == ["agent-001"]
    assert [r["step"] for r in trackio_logs(trackio_project, "agent-001") if "train/reward" in r] == [1, 2, 3]

    stored = [p for p in Path(tmp_path).rglob("*") if p.is_file() and "wandb-core" not in p.name]
    assert not [p for p in stored if WANDB_KEY.encode() in p.read_bytes()]


def _env(tmp_path: Path, trackio_project: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_API_KEY": WANDB_KEY,
            "TRACKIO_DIR": os.environ["TRACKIO_DIR"], "TRACKIO_PROJECT": trackio_project,
            "BACKEND_KEY": BACKEND_KEY}


def test_current_style_script_resumes_and_forks_with_local_backend(tmp_path, fork_launcher):
    project = f"art-local-{tmp_path.name}"
    runs = _run_current_style(fork_launcher, str(tmp_path / "runs"), tmp_path, _env(tmp_path, project))
    _check(runs, str(tmp_path / "runs"), tmp_path, project)


def test_current_style_script_resumes_and_forks_with_remote_backend(tmp_path, fork_launcher):
    port = _free_port()
    project = f"art-remote-{tmp_path.name}"
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    # the server has W&B too, offline in its own folder: it must not track (its clients do)
    env = {**_env(tmp_path, project), "TRAJFLOW_BACKEND_API_KEY": BACKEND_KEY,
           "WANDB_DIR": str(server_dir / "wandb")}
    log = server_dir / "serve.log"
    pid = fork_launcher.start(["-m", "flows.cli", "backend", "serve", "--storage", str(tmp_path / "store"),
                               "--port", str(port), "--device", "cpu"], env, REPO, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("backend did not start: " + log.read_text()[-3000:])
        runs = _run_current_style(fork_launcher, url, tmp_path, _env(tmp_path, project))
    finally:
        os.killpg(pid, signal.SIGTERM)
        try:
            fork_launcher.wait(pid, timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            fork_launcher.wait(pid, timeout=20)
    assert not (server_dir / "wandb").exists()
    _check(runs, str(tmp_path / "store"), tmp_path, project)
