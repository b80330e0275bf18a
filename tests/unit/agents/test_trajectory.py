"""The data model: ART-style construction from openai Choices, exact JSON round trip, groups."""

import asyncio
import math

import pytest
from openai.types.chat.chat_completion import ChatCompletion

from agents import RecordedException, SampledTurn, Scenario, Trajectory, TrajectoryGroup
from agents.trajectory import History


def _response(tool_call: bool = False) -> ChatCompletion:
    message = {"role": "assistant", "content": None if tool_call else "4"}
    if tool_call:
        message["tool_calls"] = [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
        ]
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "agent@3",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls" if tool_call else "stop",
                    "message": message,
                    "token_ids": [7, 8],
                    "prompt_token_ids": [1, 2, 3],
                    "policy": "agent@3",
                    "logprobs": {
                        "content": [
                            {"token": "a", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                            {"token": "b", "logprob": -1.25, "bytes": None, "top_logprobs": []},
                        ]
                    },
                }
            ],
        }
    )


def test_choice_is_captured_with_tokens_and_logprobs():
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}], reward=0.0)
    traj.messages_and_choices.append(_response().choices[0])
    turn = traj.messages_and_choices[1]
    assert isinstance(turn, SampledTurn)
    assert turn.prompt_token_ids == [1, 2, 3]
    assert turn.token_ids == [7, 8]
    assert turn.logprobs == [-0.5, -1.25]
    assert turn.policy == "agent@3"
    assert turn.trainable
    assert traj.messages() == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_json_round_trip_is_exact_with_tools_and_histories():
    traj = Trajectory(
        messages_and_choices=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        reward=0.75,
        metrics={"turns": 2, "ok": True},
        metadata={"scenario": "s1"},
    )
    traj.messages_and_choices.append(_response(tool_call=True).choices[0])
    traj.messages_and_choices.append({"role": "tool", "tool_call_id": "call_0", "content": "4"})
    traj.additional_histories.append(History(messages_and_choices=[_response().choices[0]]))
    traj.log("done")
    text = traj.model_dump_json()
    back = Trajectory.model_validate_json(text)
    assert back.model_dump_json() == text
    assert back == traj
    assert back.messages_and_choices[2].message["tool_calls"][0]["function"]["name"] == "add"
    assert isinstance(back.additional_histories[0].messages_and_choices[0], SampledTurn)


def test_vllm_token_id_strings_are_parsed():
    data = _response().choices[0].model_dump()
    data.pop("token_ids")
    for i, entry in enumerate(data["logprobs"]["content"]):
        entry["token"] = f"token_id:{40 + i}"
    turn = SampledTurn.from_choice(data)
    assert turn.token_ids == [40, 41]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_is_rejected(bad):
    with pytest.raises(ValueError, match="finite"):
        Trajectory(reward=bad)


def test_bad_items_are_rejected_with_a_clear_error():
    traj = Trajectory()
    with pytest.raises(ValueError, match="role"):
        traj.messages_and_choices.append({"content": "no role"})
    with pytest.raises(TypeError, match="messages_and_choices"):
        traj.messages_and_choices.append(42)
    with pytest.raises(ValueError, match="logprobs"):
        SampledTurn(message={"role": "assistant"}, token_ids=[1, 2], logprobs=[0.0])


def test_scenario_validation_and_round_trip():
    s = Scenario(id="q-1", split="val", payload={"a": 1})
    assert Scenario.model_validate_json(s.model_dump_json()) == s
    for bad in ["", "../x", "a/b"]:
        with pytest.raises(ValueError):
            Scenario(id=bad)
    with pytest.raises(ValueError, match="JSON"):
        Scenario(id="x", payload={"f": object()})


def test_group_from_awaitables_records_exceptions():
    async def ok(r):
        return Trajectory(reward=r)

    async def boom():
        raise RuntimeError("tool exploded")

    async def not_a_trajectory():
        return {"reward": 1}

    async def main():
        group = await TrajectoryGroup([ok(1.0), boom(), ok(0.0), not_a_trajectory()])
        return group

    group = asyncio.run(main())
    assert sorted(group.rewards) == [0.0, 1.0]
    assert {e.type for e in group.exceptions} == {"RuntimeError", "TypeError"}
    assert "tool exploded" in [e.message for e in group.exceptions][0] or "tool exploded" in group.exceptions[1].message
    back = TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back.rewards == group.rewards
    assert all(isinstance(e, RecordedException) for e in back.exceptions)
    assert not math.isnan(sum(back.rewards))


def test_a_choice_object_is_captured_as_its_dump_is():
    """SampledTurn reads an openai Choice's fields off the object; the result equals capturing its JSON dump."""
    from openai.types.chat import ChatCompletion

    from agents.trajectory import SampledTurn

    def lp(token):
        return {"token": token, "logprob": -0.25, "bytes": None, "top_logprobs": []}

    answers = [
        {"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6], "prompt_token_ids": [1, 2], "policy": "m@3",
         "message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
             {"id": "t", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
         "logprobs": {"content": [lp("a"), lp("b")]}},
        {"index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "hi"},
         "logprobs": {"content": [lp("token_id:7"), lp("token_id:8")]}},  # ids only in the tokens
        {"index": 2, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}, "logprobs": None},
    ]
    completion = ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 0, "model": "m@1",
                                                "choices": answers})
    for choice in completion.choices:
        turn = SampledTurn.from_choice(choice)
        assert turn == SampledTurn.from_choice(choice.model_dump(mode="json"))
    assert SampledTurn.from_choice(completion.choices[1]).token_ids == [7, 8]
    assert SampledTurn.from_choice(completion.choices[0]).message["tool_calls"][0]["function"]["name"] == "add"
