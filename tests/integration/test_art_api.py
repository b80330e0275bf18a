"""ART's older cheat-sheet loop (`model.train(groups, config=TrainConfig(...))`), verbatim but for imports, on
tiny-random with LocalBackend on the CPU; it still works and warns that ART deprecated it.

Also: max_exceptions within and beyond the limit, and the README's "Coming from ART" snippet run as written. The
current form (iterate_dataset, backend.train), resuming in a new process, forking and RemoteBackend against a real
`trajflow backend serve` are in test_art_current_api.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from pathlib import Path

import pytest

from agents import GatherError, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, gather_trajectory_groups
from backends import LocalBackend
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
                with pytest.warns(DeprecationWarning, match=r"backend\.train\(model, groups, learning_rate"):
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


def test_readme_coming_from_art_snippet_runs(tmp_path, fork_launcher, judge_server):
    """The README's loop (ART's current form, RULER scoring), as written, with the model swapped for tiny-random to fit
    CI and the judge for a scripted one."""
    from tests.fixtures_judge import answer_key_judge

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Coming from ART"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "backend.train(model, groups, learning_rate=" in code and "iterate_dataset(" in code
    code = code.replace('base_model="smollm2-135m"', 'base_model="tiny-random"')
    code = code.replace('base_url="https://api.openai.com/v1"', f'base_url="{judge_server.base_url}"')
    judge_server.script(*[answer_key_judge("4")] * 6)  # 3 steps of 2 groups
    script = tmp_path / "readme_loop.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAJFLOW_STORAGE": str(tmp_path / "runs")}
    code, _, err = run_script(fork_launcher, [str(script)], env, tmp_path, tmp_path)
    assert code == 0, err[-3000:]
    store = RunStore(str(tmp_path / "runs"), "my-agent", "agent-001")
    assert store.latest_step() == 3 and len(judge_server.chat_requests) == 6
    assert all("ruler_score" in t.metrics for g in store.read_groups(3, "scored.parquet") for t in g.trajectories)
    assert "val/reward" in store.read_manifest(3).metrics
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
