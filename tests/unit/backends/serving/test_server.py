"""The embedded server on tiny-random, through the real openai client: tokens, logprobs, seeds, n, load, errors."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from tests.fixtures_server import API_KEY, TOOL_QUESTION, TOOLS

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 3?"}]


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's raw logits at each sampled position (temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


async def test_tokens_and_logprobs_match_a_teacher_forced_forward(client, tiny_hf):
    model, tok = tiny_hf
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=24,
                                             temperature=1.0, logprobs=True, top_logprobs=3, seed=7)
    expected_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(expected_prompt)
    choice = r.choices[0]
    ids = choice.token_ids
    assert choice.prompt_token_ids == r.prompt_token_ids
    assert len(ids) == len(choice.logprobs.content) == r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(expected_prompt)
    returned = torch.tensor([c.logprob for c in choice.logprobs.content])
    reference = teacher_forced_logprobs(model, r.prompt_token_ids, ids)
    torch.testing.assert_close(returned, reference, atol=1e-4, rtol=1e-4)
    first = choice.logprobs.content[0]
    assert len(first.top_logprobs) == 3
    assert first.top_logprobs[0].logprob >= first.top_logprobs[2].logprob
    assert first.top_logprobs[0].logprob >= first.logprob - 1e-6
    assert first.token == tok.decode([ids[0]])
    if choice.finish_reason == "stop":
        assert ids[-1] == tok.eos_token_id
    else:
        assert choice.finish_reason == "length" and len(ids) == 24


async def test_same_seed_same_tokens_other_seed_other_tokens(client):
    async def run(seed):
        r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, seed=seed)
        return r.choices[0].token_ids

    a, b, c = await asyncio.gather(run(11), run(11), run(12))
    assert a == b
    assert a != c


async def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch(client):
    alone = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, seed=5)
    crowd = [client.chat.completions.create(model="tiny-random", max_tokens=16, seed=100 + i,
                                            messages=[{"role": "user", "content": f"noise {i}"}]) for i in range(8)]
    together = await asyncio.gather(
        client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=16, seed=5), *crowd)
    assert together[0].choices[0].token_ids == alone.choices[0].token_ids


async def test_n_choices(client, tiny_hf):
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=12, n=4, seed=3,
                                             logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    seqs = [c.token_ids for c in r.choices]
    assert len({tuple(s) for s in seqs}) > 1
    assert r.usage.completion_tokens == sum(len(s) for s in seqs)
    for c in r.choices:  # each choice's logprobs are its own (shared prompt prefill copied correctly)
        reference = teacher_forced_logprobs(tiny_hf[0], r.prompt_token_ids, c.token_ids)
        torch.testing.assert_close(torch.tensor([x.logprob for x in c.logprobs.content]), reference,
                                   atol=1e-4, rtol=1e-4)


async def test_greedy_is_argmax(client, tiny_hf):
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8, temperature=0)
    a = r.choices[0].token_ids
    with torch.no_grad():
        logits = tiny_hf[0](input_ids=torch.tensor([r.prompt_token_ids + a])).logits[0]
    assert logits[len(r.prompt_token_ids) - 1 : -1].argmax(-1).tolist() == a[: len(a)]


async def test_top_p_small_keeps_only_the_most_likely_token(client, tiny_hf):
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8, top_p=1e-6,
                                             seed=1, logprobs=True, top_logprobs=1)
    for entry in r.choices[0].logprobs.content:
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


@pytest.mark.parametrize("temperature", [9e-6, 1e-30, 1e-39, 1e-45, 5e-324])
async def test_a_temperature_that_underflows_is_greedy(client, temperature):
    """Below 1e-5 (vLLM's threshold) sampling is greedy: float32 logits / 1e-39 overflow, and 1e-39 is subnormal."""
    greedy = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8,
                                                  temperature=0, extra_body={"ignore_eos": True})
    tiny = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8, seed=1,
                                                temperature=temperature, extra_body={"ignore_eos": True})
    assert tiny.choices[0].token_ids == greedy.choices[0].token_ids


@pytest.mark.parametrize("top_p", [1e-30, 1e-39, 1e-46, 5e-324])
async def test_a_top_p_that_underflows_keeps_the_most_likely_token(client, top_p):
    """top_p below float32's smallest normal (or rounding to 0) still keeps the top-1 token."""
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=8, top_p=top_p,
                                             seed=1, logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    for entry in r.choices[0].logprobs.content:
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


async def test_64_concurrent_requests_are_all_answered(client, tiny_server):
    steps_before = tiny_server.engine.stats["decode_steps"]
    replies = await asyncio.gather(*[
        client.chat.completions.create(model="tiny-random", max_tokens=8, seed=i,
                                       messages=[{"role": "user", "content": f"question {i}"}]) for i in range(64)])
    assert len(replies) == 64
    assert all(r.choices[0].token_ids and r.choices[0].finish_reason in ("stop", "length") for r in replies)
    # batched: far fewer decode steps than one sequence after another (64 x up to 7)
    assert tiny_server.engine.stats["decode_steps"] - steps_before < 64 * 7 / 2


async def test_max_tokens_stop_strings_and_stop_token_ids(client, tiny_hf):
    tok = tiny_hf[1]
    r = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_completion_tokens=5,
                                             seed=2, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].token_ids) == 5
    full = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=30, seed=4,
                                                extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    stop = text[10:12]
    cut = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=30, seed=4,
                                               stop=[stop], extra_body={"ignore_eos": True})
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.message.content == text[: text.index(stop)]
    assert choice.token_ids == full.choices[0].token_ids[: len(choice.token_ids)]
    assert stop in tok.decode(choice.token_ids)
    target = full.choices[0].token_ids[3]
    by_id = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=30, seed=4,
                                                 extra_body={"ignore_eos": True, "stop_token_ids": [target]})
    ids = by_id.choices[0].token_ids
    assert ids[-1] == target and target not in ids[:-1] and by_id.choices[0].stop_reason == target


async def test_vllm_extras_are_accepted(client):
    r = await client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, max_tokens=3, logprobs=True, seed=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs_mode": "raw_logprobs",
                    "some_future_flag": 1, "top_k": -1})
    entry = r.choices[0].logprobs.content[0]
    assert entry.token == f"token_id:{r.choices[0].token_ids[0]}"


async def test_streaming(client):
    plain = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=6, seed=9)
    stream = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=6, seed=9,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


async def test_tool_call_round_trip(tool_server, tiny_hf):
    client = openai.AsyncOpenAI(base_url=tool_server.base_url, api_key=API_KEY, max_retries=0)
    first = await client.chat.completions.create(model="tiny-tools", messages=TOOL_QUESTION, tools=TOOLS,
                                                 tool_choice="auto", temperature=0, max_tokens=48)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    messages = TOOL_QUESTION + [choice.message.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = await client.chat.completions.create(model="tiny-tools", messages=messages, tools=TOOLS,
                                                  max_tokens=8, seed=0)
    # the re-rendered conversation extends the first turn token for token (what the trainer relies on)
    turn = first.prompt_token_ids + choice.token_ids
    assert second.prompt_token_ids[: len(turn)] == turn
    assert "sunny, 21 C" in tiny_hf[1].decode(second.prompt_token_ids[len(turn):])
    # tool_choice="none": the same output comes back as plain text
    none = await client.chat.completions.create(model="tiny-tools", messages=TOOL_QUESTION, tools=TOOLS,
                                                tool_choice="none", temperature=0, max_tokens=48)
    assert none.choices[0].message.tool_calls is None or none.choices[0].message.tool_calls == []
    assert none.choices[0].message.content.startswith("<tool_call>")
    await client.close()


async def test_models_and_health(client, tiny_server):
    listed = await client.models.list()
    assert listed.data[0].id == "tiny-random"
    reply = httpx.get(tiny_server.url + "/health", headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200


async def test_unknown_model_is_404_listing_names(client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert "no-such-model" in str(e.value) and "tiny-random" in str(e.value)
    assert e.value.body["type"] == "NotFoundError"


# Malformed messages, bad parameters and prompts longer than the context: rows of test_bad_inputs_server.py.


def test_the_key_guards_every_route_but_health(tiny_server):
    """As vLLM: /health answers without the key (a load balancer's probe carries none); /v1/* needs it."""
    with openai.OpenAI(base_url=tiny_server.base_url, api_key="wrong", max_retries=0) as wrong, pytest.raises(
            openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=2)
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                         ("GET", "/v1/no-such-route"), ("GET", "/docs"), ("GET", "/openapi.json")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            reply = httpx.request(method, tiny_server.url + path, headers=headers,
                                  json={"lora_name": "x", "lora_path": "/tmp"} if method == "POST" else None)
            assert reply.status_code == 401 and "API key" in reply.json()["error"]["message"], (method, path)
