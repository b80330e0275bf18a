"""`inference.replicas: 2`: two real embedded servers on tiny-random behind the policy client's router.

Asserted: a publish loads the adapter on every replica and probes each; concurrent requests spread over the
replicas by outstanding requests; every call of a rollout goes to the replica its first call went to; a replica
that dies is taken out and the requests sent to it (a rollout sticky to it included) are answered by the other.
"""

from __future__ import annotations

import asyncio

import pytest

from agents.client import rollout_context
from tasks.publish import publish_policy_fn
from tasks.run_config import load_config
from tasks.support.runtime import close_runtime, get_runtime
from tasks.training import initialize_policy_fn


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_model_path):
    config = load_config("configs/tiny.yaml", [f"storage={tmp_path_factory.mktemp('replicas') / 'runs'}",
                                               "run=replicas", "inference.replicas=2", "inference.device=cpu"])
    try:
        yield config, get_runtime(config)
    finally:
        close_runtime(config)


def _router(client):
    """The ReplicaRouter under a policy client: AsyncOpenAI -> httpx client -> PolicyTransport -> router."""
    return client._client._transport._inner


async def _ask(client, model: str, text: str) -> str:
    r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=3)
    return r.choices[0].message.content


def test_publish_loads_and_probes_the_adapter_on_every_replica(replicas):
    config, rt = replicas
    published = publish_policy_fn(config, 0, initialize_policy_fn(config))
    assert len(rt.base_urls) == 2 and rt.base_urls[0] != rt.base_urls[1]
    assert published["metrics"]["publish/replicas"] == 2
    assert published["metrics"]["publish/probe_max_abs_diff"] < 1e-3  # the worst of the two probes
    for inference in rt.inference_clients():
        assert config.policy(0) in asyncio.run(inference.models())


def test_replica_router_spreads_load_and_keeps_a_rollout_sticky(replicas):
    config, rt = replicas
    policy = config.policy(0)

    async def rollout(i: int) -> tuple[int, int]:
        with rollout_context(seed_material=f"rollout-{i}") as ctx:
            for turn in range(3):
                await _ask(client, policy, f"turn {turn} of rollout {i}")
            return ctx.replica, len(ctx.records)

    async def main():
        try:
            router = _router(client)
            await asyncio.gather(*(_ask(client, policy, f"q{i}") for i in range(4)))
            spread = list(router.sent)
            placed = await asyncio.gather(*(rollout(i) for i in range(4)))
            return spread, placed, list(router.sent)
        finally:
            await client.close()

    client = rt.client()
    spread, placed, sent = asyncio.run(main())
    assert spread == [2, 2]  # four at once: each to the replica with fewer outstanding
    assert sorted(r for r, _ in placed) == [0, 0, 1, 1] and all(calls == 3 for _, calls in placed)
    assert sent == [2 + 6, 2 + 6]  # every turn of a rollout went where its first turn went


def test_a_dead_replica_is_taken_out_and_its_requests_retried(replicas):
    config, rt = replicas
    policy = config.policy(0)
    rt._servers.pop(1).stop()  # replica 1 dies (its URL stays in the runtime's list, as a crashed server's would)

    async def main():
        try:
            router = _router(client)
            with rollout_context(seed_material="sticky-to-the-dead-one") as ctx:
                ctx.replica = 1
                first = await _ask(client, policy, "hello")
                second = await _ask(client, policy, "again")
            answers = await asyncio.gather(*(_ask(client, policy, f"q{i}") for i in range(3)))
            return ctx.replica, [first, second, *answers], list(router.alive), list(router.sent)
        finally:
            await client.close()

    client = rt.client()
    moved_to, answers, alive, sent = asyncio.run(main())
    assert moved_to == 0 and alive == [True, False] and sent == [5, 0]
    assert all(isinstance(a, str) for a in answers)
