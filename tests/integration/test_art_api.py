"""ART's cheat-sheet loop, verbatim but for imports, on tiny-random with LocalBackend on the CPU.

Also: resume in a new process from storage, max_exceptions within and beyond the limit, the
README's "Coming from ART" snippet, and RemoteBackend against a real `trajflow backend serve`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agents import GatherError, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from backends import LocalBackend, RemoteBackend
from storage.store import RunStore
from tests.paths import REPO

NUM_STEPS, GROUP_SIZE = 2, 3
SCENARIOS = ["What is 2+2?", "Name a colour."]

ROLLOUT = '''
async def rollout(model, scenario):
    client = model.openai_client()
    messages = [{"role": "user", "content": scenario}]
    traj = Trajectory(messages_and_choices=[*messages], reward=0.0)
    resp = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=6)
    choice = resp.choices[0]
    traj.messages_and_choices.append(choice)
    traj.reward = float(len(choice.message.content or "") % 3)
    return traj
'''

CHEAT_SHEET = '''
import asyncio, sys
from agents import TrainableModel, Trajectory, TrajectoryGroup, TrainConfig, gather_trajectory_groups
from backends import LocalBackend

NUM_STEPS, GROUP_SIZE = int(sys.argv[2]), 3
scenarios = ["What is 2+2?", "Name a colour."]
''' + ROLLOUT + '''
async def main():
    model = TrainableModel(name="agent-001", project="my-agent", base_model="tiny-random")
    backend = LocalBackend(storage=sys.argv[1])
    await model.register(backend)
    for step in range(await model.get_step(), NUM_STEPS):
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, s) for _ in range(GROUP_SIZE)) for s in scenarios))
        await model.train(groups, config=TrainConfig(learning_rate=1e-5))
    print("final step", await model.get_step())
    backend.close()

asyncio.run(main())
'''

exec(ROLLOUT)  # the same rollout the scripts run, defined here as `rollout`


def test_cheat_sheet_loop_trains_commits_and_serves_latest(tmp_path, tiny_model_path):
    async def main():
        model = TrainableModel(name="agent-001", project="my-agent", base_model="tiny-random")
        backend = LocalBackend(storage=str(tmp_path))
        try:
            await model.register(backend)
            assert await model.get_step() == 0
            for step in range(await model.get_step(), NUM_STEPS):
                groups = await gather_trajectory_groups(
                    TrajectoryGroup(rollout(model, s) for _ in range(GROUP_SIZE)) for s in SCENARIOS)
                result = await model.train(groups, config=TrainConfig(learning_rate=1e-5))
                assert result.step == step + 1
                # published through the trainer's probe record: all greedy tokens agree, float32 tolerance
                assert result.metrics["publish/probe_common_prefix"] == 16.0
                m = result.metrics
                assert m["publish/probe_max_abs_diff"] <= m["publish/probe_tolerance"] == 0.05
            assert await model.get_step() == NUM_STEPS
            # model=model.name is the latest step; model@1 is pinned
            served = {m.id for m in (await model.openai_client().models.list()).data}
            # the flow's publish path: the last two steps stay served, older ones are unloaded
            assert {f"agent-001@{NUM_STEPS}", f"agent-001@{NUM_STEPS - 1}"} <= served
            assert not {f"agent-001@{s}" for s in range(NUM_STEPS - 1)} & served
            traj = await rollout(model, SCENARIOS[0])
            assert traj.messages_and_choices[-1].policy in ("agent-001", f"agent-001@{NUM_STEPS}")
            metrics = await model.log([await TrajectoryGroup(rollout(model, s) for _ in range(2))
                                       for s in SCENARIOS], split="val")
            assert "val/reward" in metrics
            assert await model.delete_checkpoints("val/reward") == [0, 1]  # keeps the newest (= best) step
        finally:
            backend.close()

    asyncio.run(main())
    store = RunStore(str(tmp_path), "my-agent", "agent-001")
    assert store.committed_steps() == [0, 1, 2]
    assert "val/reward" in store.read_manifest(2).metrics
    assert len(store.read_groups(1, "scored.parquet")) == len(SCENARIOS)  # trajectories survive retention
    assert not store.exists(1, "adapter/adapter_model.safetensors") and store.exists(2, "adapter/adapter_model.safetensors")


def run_script(launcher, argv: list[str], env: dict, cwd: Path, out_dir: Path) -> tuple[int, str, str]:
    """`python *argv` as a process of its own (forked with torch preloaded): (returncode, stdout, stderr)."""
    out, err = out_dir / f"{os.urandom(4).hex()}.out", out_dir / f"{os.urandom(4).hex()}.err"
    code = launcher.run(argv, env, cwd, out, err, timeout=300)
    return code, out.read_text(), err.read_text()


def test_resume_in_a_new_process(tmp_path, fork_launcher):
    script = tmp_path / "loop.py"
    script.write_text(CHEAT_SHEET)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code, out, err = run_script(fork_launcher, [str(script), str(tmp_path / "runs"), "1"], env, REPO, tmp_path)
    assert code == 0, err[-3000:]
    assert "final step 1" in out
    code, out, err = run_script(fork_launcher, [str(script), str(tmp_path / "runs"), "3"], env, REPO, tmp_path)
    assert code == 0, err[-3000:]
    assert "final step 3" in out
    assert RunStore(str(tmp_path / "runs"), "my-agent", "agent-001").committed_steps() == [0, 1, 2, 3]


def test_max_exceptions_within_and_beyond_the_limit():
    async def ok():
        return Trajectory(reward=1.0)

    async def boom():
        raise RuntimeError("tool exploded")

    async def main():
        groups = await gather_trajectory_groups(
            [TrajectoryGroup([ok(), boom(), ok()]), TrajectoryGroup([ok(), ok()])], max_exceptions=1,
            pbar_desc=None)
        assert [len(g.trajectories) for g in groups] == [2, 2]
        assert groups[0].exceptions[0].message == "tool exploded"
        groups = await gather_trajectory_groups([TrajectoryGroup([ok(), boom(), boom(), ok()])],
                                                max_exceptions=0.5, pbar_desc=None)  # 2 of 4 allowed
        assert len(groups[0].exceptions) == 2
        with pytest.raises(GatherError, match="tool exploded"):
            await gather_trajectory_groups([TrajectoryGroup([boom(), boom(), ok()])], max_exceptions=1,
                                           pbar_desc=None)
        dropped = await gather_trajectory_groups([TrajectoryGroup([ok()]), TrajectoryGroup([ok(), ok()])],
                                                 after_each=lambda g: None if len(g.trajectories) == 1 else g,
                                                 pbar_desc=None)
        assert [len(g.trajectories) for g in dropped] == [2]

    asyncio.run(main())


def test_readme_coming_from_art_snippet_runs(tmp_path, fork_launcher):
    """The README's loop, as written, with the model swapped for tiny-random to fit CI."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Coming from ART"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    code = code.replace('base_model="smollm2-135m"', 'base_model="tiny-random"')
    script = tmp_path / "readme_loop.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAJFLOW_STORAGE": str(tmp_path / "runs")}
    code, _, err = run_script(fork_launcher, [str(script)], env, tmp_path, tmp_path)
    assert code == 0, err[-3000:]
    assert RunStore(str(tmp_path / "runs"), "my-agent", "agent-001").latest_step() == 3
    assert f"my-agent/agent-001: at step 0 (the untrained policy) in {tmp_path / 'runs'}/my-agent/agent-001" in err
    # run again, finished: it says where the run is and why the loop has nothing to do
    code, _, err = run_script(fork_launcher, [str(script)], env, tmp_path, tmp_path)
    assert code == 0, err[-3000:]
    assert (f"my-agent/agent-001: already at step 3 in {tmp_path / 'runs'}/my-agent/agent-001; the next update "
            "trains step 4 (a loop `range(await model.get_step(), N)` has nothing to do unless N > 3)") in err
    assert "taking over the lease" not in err  # the first run let the run go when it exited
    assert RunStore(str(tmp_path / "runs"), "my-agent", "agent-001").latest_step() == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_backend_against_trajflow_backend_serve(tmp_path, fork_launcher):
    port = _free_port()
    env = {**os.environ, "TRAJFLOW_BACKEND_API_KEY": "k-remote-123"}
    log = tmp_path / "serve.log"
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
        assert httpx.post(url + "/backend/step", json={"project": "p", "name": "n"}).status_code == 401

        async def main():
            backend = RemoteBackend(url, api_key="k-remote-123")
            model = TrainableModel(name="remote-001", project="my-agent", base_model="tiny-random")
            await model.register(backend)
            assert await model.get_step() == 0
            groups = await gather_trajectory_groups(
                (TrajectoryGroup(rollout(model, s) for _ in range(GROUP_SIZE)) for s in SCENARIOS), pbar_desc=None)
            result = await model.train(groups, config=TrainConfig(learning_rate=1e-5))
            assert result.step == 1 and "train/reward" in result.metrics
            assert await model.get_step() == 1
            await backend.close()

        asyncio.run(main())
        assert RunStore(str(tmp_path / "store"), "my-agent", "remote-001").committed_steps() == [0, 1]
    finally:
        os.killpg(pid, signal.SIGTERM)
        try:
            fork_launcher.wait(pid, timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            fork_launcher.wait(pid, timeout=20)
