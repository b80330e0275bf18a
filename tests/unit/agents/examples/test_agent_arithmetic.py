"""Arithmetic agent: scenarios, the reward on hand-written replies, rollouts over real HTTP."""

from __future__ import annotations

import pydantic
import pytest
from openai import AsyncOpenAI

from agents import Scenario, Trajectory
from agents.examples.arithmetic import FEW_SHOT, ArithmeticAgent, score_reply
from agents.registry import get_agent


@pytest.fixture
def agent() -> ArithmeticAgent:
    return ArithmeticAgent()


def test_scenarios_deterministic_and_reordered_by_seed(agent):
    a, b = agent.scenarios("train", seed=0), ArithmeticAgent().scenarios("train", seed=0)
    assert [s.model_dump() for s in a] == [s.model_dump() for s in b]
    c = agent.scenarios("train", seed=1)
    assert sorted(s.id for s in c) == sorted(s.id for s in a) and [s.id for s in c] != [s.id for s in a]
    assert all(s.split == "train" for s in a)


def test_splits_are_disjoint_even_for_swapped_operands(agent):
    pairs = {}
    total = 0
    for split in ("train", "val", "test"):
        scen = agent.scenarios(split, seed=0)
        total += len(scen)
        for s in scen:
            p = s.payload
            key = (p["op"], min(p["a"], p["b"]), max(p["a"], p["b"]))
            assert pairs.setdefault(key, split) == split, f"{key} in {pairs[key]} and {split}"
            assert p["answer"] == (p["a"] + p["b"] if p["op"] == "add" else p["a"] * p["b"])
    assert total == 2 * 12 * 12 - 4  # the few-shot problems (both orders) are left out
    assert 50 <= len(agent.scenarios("val", 0)) <= 100
    shots = {(op, a, b) for op, a, b, _ in FEW_SHOT}
    assert not shots & {(op, a, b) for op, a, b in pairs}


@pytest.mark.parametrize("text, reward, correct, format_ok", [
    ("<answer>42</answer>", 1.0, True, True),
    ("  <answer> 42 </answer>\n", 1.0, True, True),
    ("6 * 7 = 42, so <answer>42</answer>", 1.0, True, False),       # right value, extra prose: still correct
    ("<answer>41</answer>", 0.1, False, True),                     # well-formed, wrong: format credit
    ("<answer>42</answer><answer>41</answer>", 1.0, True, False),  # first tag counts
    ("<answer>41</answer> <answer>42</answer>", 0.0, False, False),
    ("The answer is 42.", 0.0, False, False),                      # no tag
    ("<answer>forty-two</answer>", 0.0, False, False),
    ("<answer>42.0</answer>", 0.0, False, False),
    ("<answer>42", 0.0, False, False),
    ("", 0.0, False, False),
    (None, 0.0, False, False),
])
def test_score_reply(text, reward, correct, format_ok):
    g = score_reply(text, 42)
    assert (g["reward"], g["correct"], g["format_ok"]) == (reward, correct, format_ok)


def _scenario(agent, op="mul", a=6, b=7) -> Scenario:
    return next(s for split in ("train", "val", "test") for s in agent.scenarios(split, 0)
                if s.payload["op"] == op and (s.payload["a"], s.payload["b"]) == (a, b))


@pytest.mark.parametrize("reply, expected", [
    ({"role": "assistant", "content": "<answer>42</answer>"}, 1.0),
    ({"role": "assistant", "content": "<answer>24</answer>"}, 0.1),
    ({"role": "assistant", "content": "sure! 6*7 is a product"}, 0.0),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{"}}]}, 0.0),
    (None, 0.0),  # no reply at all: the few-shot answers in the prompt must not count
])
def test_reward_from_hand_written_trajectory(agent, reply, expected):
    s = _scenario(agent)
    traj = Trajectory(messages_and_choices=agent.messages(s) + ([reply] if reply else []))
    assert agent.reward(s, traj) == expected


def test_format_reward_option_and_config_errors():
    agent = get_agent("arithmetic", format_reward=0.2, max_operand=9)
    s = _scenario(agent)
    traj = Trajectory(messages_and_choices=agent.messages(s) + [{"role": "assistant", "content": "<answer>1</answer>"}])
    assert agent.reward(s, traj) == 0.2
    assert agent.config()["max_operand"] == 9
    with pytest.raises(pydantic.ValidationError, match="max_opernd"):
        get_agent("arithmetic", max_opernd=9)
    with pytest.raises(pydantic.ValidationError, match="min_operand 9 > max_operand 3"):
        get_agent("arithmetic", min_operand=9, max_operand=3)
    with pytest.raises(pydantic.ValidationError, match="operations"):
        get_agent("arithmetic", operations=["pow"])


async def test_rollout_correct_answer_over_http(agent, scripted_server, scripted_client):
    s = _scenario(agent)
    scripted_server.replies = ["<answer>42</answer>"]
    traj = await agent.rollout(scripted_client, "agent@3", s)
    assert traj.reward == 1.0 == agent.reward(s, traj)
    assert traj.metrics["correct"] == 1 and traj.metrics["format_ok"] == 1
    assert traj.metadata["scenario_id"] == s.id
    turn = traj.sampled_turns()[-1]
    assert turn.trainable and turn.token_ids == list(b"<answer>42</answer>") and turn.policy == "agent@3"
    req = scripted_server.requests[0]
    assert req["model"] == "agent@3" and req["temperature"] == 1.0 and req["max_tokens"] == 16
    assert req["messages"][-1] == {"role": "user", "content": "What is 6 * 7?"} and "tools" not in req


async def test_rollout_garbage_is_scored_not_raised(agent, scripted_server, scripted_client):
    s = _scenario(agent)
    scripted_server.replies = ["\x00\ufffd I like turtles <answer>"]
    traj = await agent.rollout(scripted_client, "agent@0", s)
    assert traj.reward == 0.0 and traj.metrics["correct"] == 0 and traj.metrics["format_ok"] == 0
    assert traj.error is None and "expected 42, got None" in traj.logs[-1]


async def test_rollout_leaves_logprobs_and_seed_to_the_client_layer(agent, scripted_server):
    """With a plain openai client the request carries only what the agent itself sets."""
    scripted_server.replies = ["<answer>1</answer>"]
    async with AsyncOpenAI(base_url=scripted_server.base_url, api_key="x", max_retries=0) as client:
        traj = await agent.rollout(client, "base", _scenario(agent))
    assert traj.reward == 0.1
    req = scripted_server.requests[0]
    assert not {"logprobs", "seed", "return_token_ids", "extra_body"} & set(req)


async def test_rollout_on_embedded_tiny_random_server(agent, tiny_server):
    """A real model that answers noise: every rollout ends scored, with the exact sampled tokens kept."""
    from agents.client import policy_client
    from tests.fixtures_server import API_KEY

    client = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        for s in agent.scenarios("val", seed=0)[:3]:
            traj = await agent.rollout(client, "tiny-random", s)
            assert traj.reward in (0.0, 0.1, 1.0) and traj.reward == agent.reward(s, traj)
            turn = traj.sampled_turns()[-1]
            assert turn.trainable and 1 <= len(turn.token_ids) <= 16
    finally:
        await client.close()
