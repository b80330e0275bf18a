"""`backend.train_sft(model, trajectories, ...)` on LocalBackend: a supervised step on demonstrations (ART-style
Trajectory objects or conversation dicts), committed and served as the run's next step."""

from __future__ import annotations

import asyncio

import pytest

from agents import TrainableModel, Trajectory
from backends.art.local_backend import LocalBackend
from storage.store import RunStore
from tests.fixtures_sft import ARITHMETIC, TOOL_CONVERSATION


def test_train_sft_commits_and_serves_the_next_step(tmp_path, tiny_model_path):
    async def main():
        backend = LocalBackend(storage=str(tmp_path), device="cpu")
        try:
            model = TrainableModel(name="agent-001", project="my-agent", base_model="tiny-random")
            await model.register(backend)
            trajectory = Trajectory(messages_and_choices=TOOL_CONVERSATION["messages"], tools=TOOL_CONVERSATION["tools"])
            with pytest.raises(ValueError, match="batch_sise"):
                await backend.train_sft(model, [trajectory], batch_sise=2)
            result = await backend.train_sft(model, [trajectory, *ARITHMETIC], config={"epochs": 2},
                                             learning_rate=1e-2, batch_size=2)
            return result, await model.get_step()
        finally:
            backend.close()

    result, step = asyncio.run(main())
    assert result.step == step == 1
    assert result.metrics["sft/optimizer_steps"] == 4 and result.metrics["sft/conversations"] == 4
    assert result.metrics["publish/probe_max_abs_diff"] <= result.metrics["publish/probe_tolerance"]
    store = RunStore(str(tmp_path), "my-agent", "agent-001")
    assert store.committed_steps() == [0, 1] and store.get_json(1, "training.json")["sft"]["data_sha256"]
    assert result.checkpoint_path == f"{store.step_url(1)}/adapter"
