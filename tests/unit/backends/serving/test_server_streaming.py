"""Streamed answers of the embedded server, through the real openai client: tokens arrive as they are decoded, the
deltas add up to the non-streamed answer (chat and completions, n = 1 and 2, logprobs, stop strings, tool calls),
UTF-8 split across tokens, usage, a client that leaves mid-stream, and overlapped decode."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from backends.inference.engine import EngineConfig
from backends.serving.stream_text import StreamText
from tests.fixtures_server import API_KEY, TOOL_QUESTION, TOOLS, wait_until

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def overlap_server(tiny_model_path, adapter_root):
    from backends.serving.app import start_server

    handle = start_server("tiny-random", api_key=API_KEY, config=EngineConfig(overlap_decode=True))
    yield handle
    handle.stop()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


async def _chat_both(client, **kw):
    """(non-streamed answer, streamed chunks) of the same chat request."""
    plain = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, **kw)
    stream = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True}, **kw)
    return plain, [c async for c in stream]


def _assert_chat_matches(plain, chunks, logprobs: bool):
    by = {}
    for chunk in chunks:
        for c in chunk.choices:
            entry = by.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None, "role": None})
            entry["role"] = entry["role"] or c.delta.role
            entry["text"] += c.delta.content or ""
            entry["ids"] += (c.model_extra or {}).get("token_ids") or []
            if c.logprobs is not None:
                entry["lps"] += [x.logprob for x in c.logprobs.content]
            entry["finish"] = c.finish_reason or entry["finish"]
    assert sorted(by) == [c.index for c in plain.choices]
    for choice in plain.choices:
        got = by[choice.index]
        assert got["role"] == "assistant"
        assert got["text"] == (choice.message.content or "")
        assert got["ids"] == choice.token_ids
        assert got["finish"] == choice.finish_reason
        if logprobs:
            assert got["lps"] == [x.logprob for x in choice.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(not c.choices or c.usage is None for c in chunks[:-1])
    assert chunks[0].model_extra["prompt_token_ids"] == plain.prompt_token_ids


async def test_tokens_arrive_while_the_answer_is_decoded(client, tiny_server):
    engine = tiny_server.engine
    stream = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=64, seed=1,
                                                  stream=True, extra_body={"ignore_eos": True})
    steps_at_content = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            steps_at_content.append(engine.stats["decode_steps"])
        if chunk.choices and chunk.choices[0].finish_reason:
            done_at = engine.stats["decode_steps"]
    assert len(steps_at_content) > 1
    assert steps_at_content[0] < done_at  # the first text came before the last step: not sent once done
    assert len(set(steps_at_content)) > 1


@pytest.mark.parametrize("n", [1, 2])
async def test_chat_deltas_equal_the_plain_answer(client, n):
    plain, chunks = await _chat_both(client, max_tokens=40, seed=21, n=n, logprobs=True, top_logprobs=2)
    _assert_chat_matches(plain, chunks, logprobs=True)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1


async def test_a_stop_string_split_across_tokens_never_leaks(client, tiny_hf):
    _, tok = tiny_hf
    free = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=40, seed=5)
    ids = free.choices[0].token_ids
    texts = [tok.decode([t]) for t in ids]
    k = next(k for k in range(5, len(ids) - 1) if texts[k].strip() and texts[k + 1].strip()
             and (texts[k] + texts[k + 1]) in free.choices[0].message.content)
    stop = texts[k][-1] + texts[k + 1][:2]  # the end of one token and the start of the next
    plain, chunks = await _chat_both(client, max_tokens=40, seed=5, stop=[stop], logprobs=True)
    assert plain.choices[0].finish_reason == "stop" and stop not in plain.choices[0].message.content
    _assert_chat_matches(plain, chunks, logprobs=True)
    sent = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert stop not in sent


def test_utf8_split_across_tokens_waits_for_its_character(tiny_hf):
    _, tok = tiny_hf
    text = "Grüße, 世界! 🎉🙂 naïve — ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the text must split a character across tokens"
    stream = StreamText([])
    deltas = [stream.push(tok, [t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + stream.finish(tok.decode(ids)) == tok.decode(ids)


def test_text_that_may_begin_a_stop_string_is_held(tiny_hf):
    _, tok = tiny_hf
    stream = StreamText(["END"])
    out = [stream.push(tok, tok(piece, add_special_tokens=False)["input_ids"]) for piece in ("abc E", "N", "D xyz")]
    assert out == ["abc ", "", ""]
    assert stream.finish("abc ") == ""


@pytest.mark.parametrize("n", [1, 2])
async def test_completion_deltas_equal_the_plain_answer(client, n):
    await _assert_completion_deltas_match(client, n)


@pytest.mark.parametrize("n", [1, 2])
async def test_a_completions_prompts_start_together_however_the_engine_thread_runs(client, tiny_server, monkeypatch,
                                                                                    n):
    """The server's loop paused for 50 ms after the plain answer's first hand-over to the engine: handed over one by
    one, the first prompt would be admitted and decoded alone before the second came, while the streamed run
    batches them together, and a logprob would differ in float32 rounding. The request's prompts start in one
    admission whatever the engine thread does meanwhile, so the streamed answer equals the plain one exactly."""
    engine, post, posts = tiny_server.engine, tiny_server.engine._post, []

    def post_then_pause(*items):
        post(*items)
        posts.append(items)
        if len(posts) == 1:
            time.sleep(0.05)

    monkeypatch.setattr(engine, "_post", post_then_pause)
    await _assert_completion_deltas_match(client, n)
    assert len(posts[0]) == 2  # both prompts in the first hand-over


async def _assert_completion_deltas_match(client, n):
    """Two prompts with n choices each, plain then streamed: every choice's deltas add up to its plain answer."""
    kw = dict(model="tiny-random", prompt=[[5, 6, 7, 8], [9, 10, 11]], n=n, max_tokens=30, seed=4, logprobs=2)
    plain = await client.completions.create(**kw)
    stream = await client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    texts, ids, lps, offsets, prompts, finish, usage = {}, {}, {}, {}, {}, {}, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            extra = c.model_extra or {}
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(extra.get("token_ids") or [])
            if "prompt_token_ids" in extra:
                prompts[c.index] = extra["prompt_token_ids"]
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in plain.choices:
        assert texts[c.index] == c.text
        assert ids[c.index] == c.model_extra["token_ids"]
        assert prompts[c.index] == c.model_extra["prompt_token_ids"]
        assert lps[c.index] == c.logprobs.token_logprobs
        assert offsets[c.index] == c.logprobs.text_offset
        assert finish[c.index] == c.finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


async def test_streamed_tool_calls_come_whole_in_the_last_chunk(tool_server):
    client = _client(tool_server)
    kw = dict(model="tiny-tools", messages=TOOL_QUESTION, tools=TOOLS, tool_choice="auto", temperature=0,
              max_tokens=48)
    plain = await client.chat.completions.create(**kw)
    chunks = [c async for c in await client.chat.completions.create(**kw, stream=True)]
    assert plain.choices[0].finish_reason == "tool_calls"
    sent = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call" not in sent and sent.strip() == (plain.choices[0].message.content or "")
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(x.index, x.function.name, x.function.arguments) for x in calls] == [
        (0, x.function.name, x.function.arguments) for x in plain.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    await client.close()


async def test_a_client_that_leaves_mid_stream_frees_its_sequences(tiny_server, random_adapter):
    """Mid-stream (the status line and first chunks sent), closing the connection aborts the request: its sequences
    stop, their KV slots and the LoRA slot's reference are freed."""
    engine = tiny_server.engine
    engine.load_adapter("stream-leaver@1", str(random_adapter[0]), replace=True)
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "an idle engine")
    before = engine.stats["generated_tokens"]
    body = {"model": "stream-leaver@1", "messages": MESSAGES, "n": 4, "max_tokens": 900, "ignore_eos": True,
            "seed": 2, "stream": True}
    async with httpx.AsyncClient(base_url=tiny_server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = reply.aiter_lines()
            while '"token_ids"' not in await anext(lines):
                pass
            assert engine.activity()["running"] == 4
            assert sum(engine.lora._refs) == 1
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "the engine to drop them")
    await wait_until(lambda: len(engine._free) == engine.max_batch, 30, "the KV slots to be freed")
    assert sum(engine.lora._refs) == 0
    assert engine.stats["generated_tokens"] - before < 4 * 900 / 2
    engine.unload_adapter("stream-leaver@1")


async def test_overlapped_decode_streams_the_same_tokens(overlap_server):
    client = _client(overlap_server)
    assert overlap_server.engine.overlap
    plain, chunks = await _chat_both(client, max_tokens=25, seed=8, n=2, logprobs=True)
    _assert_chat_matches(plain, chunks, logprobs=True)
    # sequences of different lengths in one batch: the shorter ones' discarded rows must not reach a stream
    short, long_ = await asyncio.gather(_chat_both(client, max_tokens=3, seed=9),
                                        _chat_both(client, max_tokens=30, seed=9))
    _assert_chat_matches(*short, logprobs=False)
    _assert_chat_matches(*long_, logprobs=False)
    await client.close()


async def test_n_2_with_a_stop_string_and_logprobs_streams_each_choice_as_its_plain_answer(client, tiny_hf):
    """Two choices, the first stopping at a stop string split across two of its tokens, with logprobs: each choice's
    deltas, token ids, logprobs and finish reason add up to that choice's plain answer."""
    _, tok = tiny_hf
    kw = dict(max_tokens=30, seed=13, n=2)
    free = await client.chat.completions.create(model="tiny-random", messages=MESSAGES, **kw)
    ids = free.choices[0].token_ids
    texts = [tok.decode([t]) for t in ids]
    k = next(k for k in range(3, len(ids) - 1) if texts[k].strip() and texts[k + 1].strip()
             and (texts[k] + texts[k + 1]) in free.choices[0].message.content)
    stop = texts[k][-1] + texts[k + 1][:2]
    plain, chunks = await _chat_both(client, **kw, stop=[stop], logprobs=True, top_logprobs=1)
    assert plain.choices[0].finish_reason == "stop"
    _assert_chat_matches(plain, chunks, logprobs=True)
    assert all(stop not in (c.delta.content or "") for chunk in chunks for c in chunk.choices)


def test_max_tokens_inside_a_utf8_character_ends_as_the_plain_text(tiny_hf):
    """The answer ends (max_tokens) on a token that ends inside a UTF-8 character: the held-back bytes come in the
    last chunk exactly as the non-streamed text has them (the engine's decode, U+FFFD included)."""
    from backends.inference.engine import Accepted, Completion
    from backends.serving.completions import CompletionRequest
    from backends.serving.stream_chunks import CompletionChunks
    from backends.serving.token_text import TokenText

    _, tok = tiny_hf
    ids = tok("ok 🎉", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    sampled = ids[:cut]
    plain_text = tok.decode(sampled, skip_special_tokens=True)  # what Engine._completion answers
    req = CompletionRequest(model="tiny-random", prompt=[[5, 6]], max_tokens=cut, stream=True)
    chunks = CompletionChunks(req, [[5, 6]], TokenText(tok))
    sent = ""
    for t in sampled:
        event = chunks.encode(tok, [(0, [Accepted(0, t, -1.0, None)])])
        sent += "".join(__import__("json").loads(line[6:])["choices"][0]["text"]
                        for line in event.decode().splitlines() if line.startswith("data: {"))
    assert "\ufffd" not in sent
    done = Completion(sampled, [-1.0] * cut, [None] * cut, "length", plain_text, None)
    last = chunks.last(0, done)
    assert sent + last["text"] == plain_text and last["finish_reason"] == "length"


async def test_an_engine_error_mid_stream_ends_the_stream_with_an_error_event(tiny_server, monkeypatch):
    """A decode step that fails after the first chunks were sent: the stream ends with an error event and [DONE]
    (the status line is gone), the request's sequences are freed, and the engine serves the next request."""
    engine = tiny_server.engine
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "an idle engine")
    decode, calls = engine._decode, []

    def failing():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected decode failure")
        return decode()

    monkeypatch.setattr(engine, "_decode", failing)
    body = {"model": "tiny-random", "messages": MESSAGES, "n": 2, "max_tokens": 60, "ignore_eos": True, "seed": 3,
            "stream": True, "logprobs": True}
    async with httpx.AsyncClient(base_url=tiny_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
    assert any('"token_ids"' in line for line in lines[:-2])  # tokens came before the failure
    assert "injected decode failure" in lines[-2] and '"error"' in lines[-2]
    assert lines[-1] == "data: [DONE]"
    monkeypatch.setattr(engine, "_decode", decode)
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "the engine to drop them")
    assert len(engine._free) == engine.max_batch
    again = await _client(tiny_server).chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=4,
                                                               seed=3, extra_body={"ignore_eos": True})
    assert again.choices[0].finish_reason == "length" and len(again.choices[0].token_ids) == 4


async def test_merged_single_adapter_streams_the_tokens_it_answers(tiny_model_path, adapter_root, random_adapter):
    """Decode steps on merged weights (`merged_single_adapter`) hand their tokens to streams as the LoRA steps do:
    with overlapped decode, n = 2 and logprobs, the deltas add up to the plain answer of the same engine."""
    from backends.serving.app import start_server

    handle = start_server("tiny-random", api_key=API_KEY, adapter_roots=[adapter_root],
                          config=EngineConfig(merged_single_adapter=True, overlap_decode=True))
    try:
        handle.engine.load_adapter("merged-stream@1", str(random_adapter[0]))
        client = _client(handle)
        kw = dict(max_tokens=24, seed=17, n=2, logprobs=True, top_logprobs=1)
        plain = await client.chat.completions.create(model="merged-stream@1", messages=MESSAGES, **kw)
        stream = await client.chat.completions.create(model="merged-stream@1", messages=MESSAGES, stream=True,
                                                      stream_options={"include_usage": True}, **kw)
        _assert_chat_matches(plain, [c async for c in stream], logprobs=True)
        assert handle.engine.stats["merged_steps"] > 0
        await client.close()
    finally:
        handle.stop()
