"""InProcessClient: the agent's rollout through an in-process engine records what it records through the server."""

from __future__ import annotations

import openai
import pytest

from agents.client import policy_client, rollout_context
from agents.examples.arithmetic import ArithmeticAgent
from agents.trajectory import SampledTurn
from backends.inference.adapters import UnknownModel
from backends.inference.engine import Engine, EngineConfig, RequestError
from backends.serving.inprocess_client import InProcessClient
from tests.fixtures_server import API_KEY


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = Engine.from_pretrained("tiny-random", config=EngineConfig(max_batch_size=8, max_loras=2))
    yield eng
    eng.shutdown()


def _turn(traj) -> SampledTurn:
    turn = traj.messages_and_choices[-1]
    assert isinstance(turn, SampledTurn)
    return turn


async def test_rollout_matches_the_http_server(engine, tiny_server):
    agent = ArithmeticAgent(max_tokens=12)
    scenario = agent.scenarios("val", seed=0)[0]
    with rollout_context("run/3/" + scenario.id + "/0"):
        local = await agent.rollout(InProcessClient(engine), "tiny-random", scenario)
    http = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0)
    with rollout_context("run/3/" + scenario.id + "/0"):
        remote = await agent.rollout(http, "tiny-random", scenario)
    a, b = _turn(local), _turn(remote)
    assert a.token_ids and len(a.logprobs) == len(a.token_ids)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert a.message["content"] == b.message["content"]
    assert a.policy == "tiny-random" and a.finish_reason == b.finish_reason
    assert local.reward == remote.reward


async def test_seeds_come_from_the_rollout_context(engine):
    client = InProcessClient(engine)
    msgs = [{"role": "user", "content": "count"}]

    async def sample(material):
        with rollout_context(material):
            r = await client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=12)
        return r.choices[0].model_dump()["token_ids"]

    first, again, other = await sample("a/0/x/0"), await sample("a/0/x/0"), await sample("a/0/x/1")
    assert first == again
    assert first != other


async def test_adapter_by_name_and_errors(engine, random_adapter, tiny_server):
    engine.load_adapter("rand", str(random_adapter[0]), replace=True)
    client = InProcessClient(engine)
    msgs = [{"role": "user", "content": "hello"}]
    base = await client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=8, temperature=0)
    lora = await client.chat.completions.create(model="rand", messages=msgs, max_tokens=8, temperature=0)
    lp_base = [e.logprob for e in base.choices[0].logprobs.content]
    lp_lora = [e.logprob for e in lora.choices[0].logprobs.content]
    assert lora.choices[0].model_dump()["policy"] == "rand"
    assert lp_base != lp_lora
    http = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0)
    for call in ({"model": "nope", "messages": msgs, "max_tokens": 4},  # unknown policy: 404
                 {"model": "tiny-random", "messages": msgs, "max_tokens": 4, "temperature": -1},  # bad request: 400
                 {"model": "tiny-random", "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 4}):
        with pytest.raises(openai.APIStatusError) as over_http:
            await http.chat.completions.create(**call)
        with pytest.raises(openai.APIStatusError) as in_process:  # the same exception as the HTTP client's
            await client.chat.completions.create(**call)
        assert type(in_process.value) is type(over_http.value)
        assert in_process.value.status_code == over_http.value.status_code
        assert in_process.value.body == over_http.value.body or call["model"] == "nope"  # (`rand` is not on the server)
        assert str(in_process.value).split(" - ")[0] == str(over_http.value).split(" - ")[0]
        assert isinstance(in_process.value.__cause__, (UnknownModel, RequestError))
    with pytest.raises(ValueError, match="stream"):
        await client.chat.completions.create(model="tiny-random", messages=msgs, stream=True)


async def test_context_overflow_ends_the_episode_as_over_http(engine):
    """A conversation past the context is the agents' ContextExhausted (an episode end), not a failed rollout."""
    from agents.examples.turn_sampling import ContextExhausted, sample_turn
    from agents.trajectory import Trajectory

    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "word " * 5000}])
    with pytest.raises(ContextExhausted, match="context length"):
        await sample_turn(InProcessClient(engine), "tiny-random", traj, max_tokens=4)
