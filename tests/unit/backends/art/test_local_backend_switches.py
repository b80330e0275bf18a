"""LocalBackend (the engine and the trainer in one process, one copy of the base weights) with the trainer's day-one
switches on: fold_lora_b and fold_lora_a move weights into their own buffers, group_qkv moves q's, k's and v's into one, fp8_base
quantizes copies, fused_rope patches the trainer's attention forwards. The engine must still serve the base model and
then the trained adapter: the publish probe (the trainer's logprobs against the served ones) passes at each step."""

from __future__ import annotations

import asyncio

import pytest

from agents import TrainableModel, Trajectory, TrajectoryGroup, gather_trajectory_groups
from backends.art.local_backend import LocalBackend

SWITCHES = {"fold": {"fold_lora_b": "on"}, "fp8": {"fp8_base": "on"}, "qkv": {"group_qkv": "on"},
            "fold-a": {"fold_lora_a": "on"}}
# the trainer's count of what each switch changed
BUILT = {"fold": "folded_lora_layers", "fp8": "fp8_lora_layers", "qkv": "grouped_qkv_layers",
         "fold-a": "row_folded_lora_layers"}


async def _rollout(model, scenario: str) -> Trajectory:
    messages = [{"role": "user", "content": scenario}]
    resp = await model.openai_client().chat.completions.create(model=model.name, messages=messages, max_tokens=4)
    return Trajectory(messages_and_choices=[*messages, resp.choices[0]],
                      reward=float(len(resp.choices[0].message.content or "") % 3))


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_local_backend_trains_and_serves_with_the_switches_on(tmp_path, tiny_model_path, switch):
    trainer = {"fused_lora": "on", "memory_efficient_ops": "on", "fused_rope": "on", **SWITCHES[switch]}

    async def main():
        backend = LocalBackend(storage=str(tmp_path), device="cpu")
        try:
            model = TrainableModel(name="agent-sw", project="switches", base_model="tiny-random", trainer=trainer)
            await model.register(backend)
            trainer_built = backend._runs["switches/agent-sw"].trainer
            results = []
            for _ in range(2):
                groups = await gather_trajectory_groups(
                    (TrajectoryGroup(_rollout(model, s) for _ in range(3)) for s in ("2+2?", "a colour?")),
                    pbar_desc=None)
                results.append(await backend.train(model, groups, learning_rate=1e-2))
            built = (getattr(trainer_built, BUILT[switch]), trainer_built.fused_rope_layers)
            return results, await model.get_step(), built
        finally:
            backend.close()

    results, step, (switched, rope) = asyncio.run(main())
    assert rope > 0 and switched > 0  # the switches took effect in LocalBackend
    assert step == 2
    for result in results:
        assert result.metrics["publish/probe_max_abs_diff"] <= result.metrics["publish/probe_tolerance"]
