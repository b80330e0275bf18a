"""The policy client against the real embedded server: token ids and logprobs always, derived seeds."""

import asyncio

import pytest

from agents import Trajectory
from agents.client import policy_client, rollout_context, rollout_seed_material


@pytest.fixture(scope="module")
def server(tiny_model_path):
    from backends.serving.app import start_server

    handle = start_server(model="tiny-random", port=0)
    yield handle
    handle.stop()


async def _ask(base_url: str, material: str | None, n_calls: int = 2):
    client = policy_client(base_url, max_retries=0)
    seen = []
    try:
        with rollout_context(material, observer=seen.append) as ctx:
            traj = Trajectory(messages_and_choices=[{"role": "user", "content": "hello"}])
            for _ in range(n_calls):
                resp = await client.chat.completions.create(model="tiny-random", messages=traj.messages(),
                                                            max_tokens=6, temperature=1.0)
                traj.messages_and_choices.append(resp.choices[0])
                traj.messages_and_choices.append({"role": "user", "content": "more"})
        return traj, seen, ctx
    finally:
        await client.close()


def test_every_answer_carries_tokens_and_logprobs(server):
    traj, seen, _ = asyncio.run(_ask(server.base_url, None))
    turns = [t for t in traj.messages_and_choices if not isinstance(t, dict)]
    assert len(turns) == 2
    for turn in turns:
        assert turn.trainable  # prompt ids, sampled ids and one logprob per sampled id
        assert turn.policy == "tiny-random"
    # the second prompt extends the first prompt + completion (what the trainer merges on)
    first, second = turns
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert len(seen) == 2 and all(r.status == 200 for r in seen)  # observed even without a seed identity


def test_rollout_identity_fixes_the_sampled_tokens(server):
    material = rollout_seed_material("run", 3, "scenario-1", 0)
    a, seen_a, ctx = asyncio.run(_ask(server.base_url, material))
    b, _, _ = asyncio.run(_ask(server.base_url, material))
    c, _, _ = asyncio.run(_ask(server.base_url, rollout_seed_material("run", 3, "scenario-1", 1)))
    ids = lambda t: [x.token_ids for x in t.messages_and_choices if not isinstance(x, dict)]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert ctx.calls == 2 and len(seen_a) == 2
    assert seen_a[0].model == "tiny-random" and seen_a[0].completion_tokens > 0 and seen_a[0].status == 200
