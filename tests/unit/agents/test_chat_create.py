"""The policy client's ``chat.completions.create`` short path (agents/chat_create.py) against a real HTTP server and
the real openai client: it sends what openai's own ``create`` sends and returns the same ``ChatCompletion``; the
cases it hands to openai still work; rollouts record the same trajectories."""

import asyncio

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from agents.chat_create import PolicyCompletions, plain_body
from agents.client import PolicyTransport, policy_client, rollout_context, rollout_seed_material
from agents.examples.arithmetic import ArithmeticAgent
from benchmarks.stub_policy import StubPolicyServer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? é"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"}]


@pytest.fixture(scope="module")
def server():
    stub = StubPolicyServer(record=True)
    yield stub
    stub.stop()


def stock_client(base_url: str) -> AsyncOpenAI:
    """openai's own client over the same transport: the reference the short path must match."""
    return AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0,
                       http_client=httpx.AsyncClient(transport=PolicyTransport()))


async def _both(server, **kwargs):
    """The request each client sends and the answer each returns for the same create(**kwargs)."""
    out = []
    for client in (stock_client(server.base_url), policy_client(server.base_url, max_retries=0)):
        try:
            with rollout_context("run/1/s/0"):
                answer = await client.chat.completions.create(**kwargs)
            out.append((server.chat_requests[-1], answer))
        finally:
            await client.close()
    return out


def test_short_path_sends_and_returns_what_openai_does(server):
    assert isinstance(policy_client(server.base_url).chat.completions, PolicyCompletions)
    (ref_req, ref), (req, got) = asyncio.run(_both(
        server, model="m@1", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=16, temperature=1.0,
        top_p=0.9, stop=["</answer>"], n=2, extra_body={"top_k": 5}, extra_headers={"X-Rollout": "7"}))
    assert req[1] == ref_req[1]  # the body: training fields, derived seed and extra_body included
    assert req[1]["seed"] == ref_req[1]["seed"] and req[1]["top_k"] == 5 and req[1]["logprobs"] is True
    for header in ("authorization", "x-rollout", "content-type"):
        assert req[0][header] == ref_req[0][header]
    # the stub stamps `created` with its clock: the two answers may straddle a second
    assert type(got) is type(ref) and got.model_dump(exclude={"created"}) == ref.model_dump(exclude={"created"})
    assert abs(got.created - ref.created) <= 1
    assert got.choices[1].token_ids == ref.choices[1].token_ids and got.choices[0].prompt_token_ids


@pytest.mark.parametrize("case", ["pydantic message", "tuple of messages", "stream false"])
def test_openai_path_cases_send_the_same_body(server, case):
    async def run():
        ref = (await _both(server, model="m", messages=MESSAGES[:2], max_tokens=4))[1][0][1]
        client = policy_client(server.base_url, max_retries=0)
        try:
            first = await client.chat.completions.create(model="m", messages=MESSAGES[:1], max_tokens=4)
            messages = {"pydantic message": [MESSAGES[0], MESSAGES[1]],
                        "tuple of messages": tuple(MESSAGES[:2]),
                        "stream false": MESSAGES[:2]}[case]
            extra = {"stream": False} if case == "stream false" else {}
            if case == "pydantic message":
                messages = [*messages, first.choices[0].message]
                ref_messages = [*MESSAGES[:2], first.choices[0].message.model_dump(exclude_unset=True)]
                assert plain_body({"model": "m", "messages": messages}) is None
            with rollout_context("run/1/s/0"):
                answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, **extra)
            return server.chat_requests[-1][1], answer, ref, (ref_messages if case == "pydantic message" else None)
        finally:
            await client.close()

    body, answer, ref, ref_messages = asyncio.run(run())
    assert answer.choices[0].message.content == "<answer>4</answer>"
    if ref_messages is not None:
        assert body["messages"] == ref_messages
    else:
        assert {k: v for k, v in body.items() if k != "stream"} == ref
        assert body.get("stream", False) is False


def test_raw_response_unknown_keyword_and_errors(server):
    async def run():
        client = policy_client(server.base_url, max_retries=0)
        try:
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES[:2])
            parsed = raw.parse()
            with pytest.raises(TypeError):
                await client.chat.completions.create(model="m", messages=MESSAGES[:2], no_such_parameter=1)
            with pytest.raises(TypeError):
                await client.chat.completions.create(messages=MESSAGES[:2])  # model is required
            return raw.status_code, parsed
        finally:
            await client.close()

    status, parsed = asyncio.run(run())
    assert status == 200 and parsed.choices[0].token_ids


def test_status_errors_are_openais(tiny_model_path):
    from backends.serving.app import start_server

    handle = start_server(model="tiny-random", port=0)

    async def run():
        client = policy_client(handle.base_url, max_retries=0)
        try:
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES[:2], max_tokens=2)
        finally:
            await client.close()

    try:
        with pytest.raises(openai.NotFoundError):
            asyncio.run(run())
    finally:
        handle.stop()


def test_arithmetic_rollouts_record_the_same_trajectories(server):
    agent = ArithmeticAgent()
    scenarios = agent.scenarios("train", 0)[:6]

    async def rollouts(client):
        out = []
        try:
            for i, scenario in enumerate(scenarios):
                with rollout_context(rollout_seed_material("run", 1, scenario.id, i)):
                    out.append((await agent.rollout(client, "m@1", scenario)).to_json_dict())
        finally:
            await client.close()
        return out

    ref = asyncio.run(rollouts(stock_client(server.base_url)))
    got = asyncio.run(rollouts(policy_client(server.base_url)))
    assert got == ref
    turn = got[0]["messages_and_choices"][-1]
    assert turn["token_ids"] and len(turn["logprobs"]) == len(turn["token_ids"]) and turn["prompt_token_ids"]


TOOL_ANSWER = {
    "id": "c", "object": "chat.completion", "created": 5, "model": "m@1", "prompt_token_ids": [1, 2],
    "system_fingerprint": None, "kv_transfer_params": None,
    "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "token_ids": [3, 4],
                 "prompt_token_ids": [1, 2], "policy": "m@1",
                 "message": {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [
                     {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
                 "logprobs": {"content": [
                     {"token": "a", "logprob": -0.5, "bytes": [97],
                      "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": None}]},
                     {"token": "b", "logprob": -1, "bytes": None, "top_logprobs": []}]}}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "prompt_tokens_details": None}}


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the string `created`, dumped by both clients
@pytest.mark.parametrize("answer", [TOOL_ANSWER, {**TOOL_ANSWER, "created": "5"}], ids=["valid", "string created"])
def test_answers_build_as_openai_builds_them(answer):
    from openai.types.chat import ChatCompletion

    stock = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
    ours = policy_client("http://127.0.0.1:9/v1")
    ref = stock._process_response_data(data=answer, cast_to=ChatCompletion, response=None)
    got = ours._process_response_data(data=answer, cast_to=ChatCompletion, response=None)
    assert type(got) is type(ref)
    for dump in ("model_dump", "to_dict", "to_json", "model_dump_json"):
        assert getattr(got, dump)() == getattr(ref, dump)()
    assert got.choices[0].message.tool_calls[0].function.name == "add"
    assert got.choices[0].token_ids == [3, 4] and got.choices[0].logprobs.content[1].logprob == -1.0
    assert got.created == answer["created"]  # the string is kept as sent (openai's construct), never coerced


def test_json_codec_writes_back_the_same_value():
    import json

    from agents.json_codec import decode

    fast = b'{"a": [1, -0.5, 1e-05, "\\u00e9"], "b": null}'
    value, encode = decode(fast)
    assert json.loads(encode(value)) == json.loads(fast)
    for raw in (b'{"lp": -Infinity, "x": NaN}', b'{"id": 123456789012345678901234567890}'):
        value, encode = decode(raw)  # the stdlib's reading, and its writing back
        assert encode(value) == json.dumps(json.loads(raw)).encode()
    assert decode(b'{"id": 123456789012345678901234567890}')[0]["id"] == 123456789012345678901234567890
    with pytest.raises(ValueError):
        decode(b"not json")


def test_plain_json_is_exact_types_only():
    from agents.chat_create import is_plain_json

    assert is_plain_json({"a": [1, 2.5, "x", None, True, {"b": []}]})
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert is_plain_json(deep)
    assert not is_plain_json({"a": (1, 2)}) and not is_plain_json({1: "x"}) and not is_plain_json([b"x"])

    class Text(str):
        pass

    assert not is_plain_json([Text("x")])
