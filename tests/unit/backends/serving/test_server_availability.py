"""One client cannot take the embedded server from the others: a request being prepared does not hold up /health,
bodies are capped, a client that disconnects has its generation cancelled in the engine, and idle connections stay
open longer than clients keep them (else a busy client's reused connection is reset: c=256's httpx.ReadError)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

import backends.serving.app as app_module
from tests.fixtures_server import API_KEY, assert_keeps_idle_connections, wait_until
from tests.unit.backends.serving.test_server import MESSAGES

AUTH = {"Authorization": f"Bearer {API_KEY}"}


async def test_health_answers_while_a_request_is_being_prepared(tiny_server, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = app_module.render_prompt

    def slow_render(tokenizer, req):  # stands in for a huge template render / tokenization
        entered.set()
        release.wait(30)
        return real(tokenizer, req)

    monkeypatch.setattr(app_module, "render_prompt", slow_render)
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        chat = asyncio.create_task(http.post(tiny_server.base_url + "/chat/completions",
                                             json={"model": "tiny-random", "messages": MESSAGES, "max_tokens": 2}))
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            health = await http.get(tiny_server.url + "/health", timeout=5)
            assert health.status_code == 200
        finally:
            release.set()
        assert (await chat).status_code == 200


async def test_a_large_completions_body_is_prepared_off_the_loop_and_a_small_one_on_it(tiny_server, monkeypatch):
    """Over INLINE_BODY_BYTES the parse runs on a worker (/health answers meanwhile); a small body's on the loop."""
    entered, release, threads = threading.Event(), threading.Event(), []
    real = app_module.text_completions.completion_prompts

    def slow_prompts(tokenizer, req, vocab):  # stands in for a huge body's parse and tokenization
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            entered.set()
            release.wait(30)
        return real(tokenizer, req, vocab)

    monkeypatch.setattr(app_module.text_completions, "completion_prompts", slow_prompts)
    large = {"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 1,  # large in bytes, short in tokens
             "stop": ["x" * (app_module.INLINE_BODY_BYTES // 8)] * 10}
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        job = asyncio.create_task(http.post(tiny_server.base_url + "/completions", json=large))
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            assert (await http.get(tiny_server.url + "/health", timeout=5)).status_code == 200
        finally:
            release.set()
        assert (await job).status_code == 200
        small = await http.post(tiny_server.base_url + "/completions",
                                json={"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 1})
        assert small.status_code == 200
    assert threads[0].startswith("tokenize") and threads[1] == "uvicorn"  # start_server's loop thread


@pytest.fixture(scope="module")
def small_body_server(tiny_model_path):
    """A server whose body cap is 64 KiB (start_server's max_body_bytes)."""
    handle = app_module.start_server("tiny-random", api_key=API_KEY, max_body_bytes=64 * 1024)
    yield handle
    handle.stop()


def test_the_body_cap_is_configurable(small_body_server):
    def chat(text: str) -> httpx.Response:
        return httpx.post(small_body_server.base_url + "/chat/completions", headers=AUTH, timeout=60,
                          json={"model": "tiny-random", "max_tokens": 2, "messages": [
                              {"role": "user", "content": "hi"}, {"role": "assistant", "content": text},
                              {"role": "user", "content": "hi"}]})

    assert chat("x" * 100).status_code == 200
    reply = chat("x" * 100_000)
    assert reply.status_code == 413 and "65536 bytes" in reply.json()["error"]["message"]


def _raw_request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8]}),
], ids=["chat", "chat-streamed", "completions"])
async def test_a_client_that_disconnects_has_its_generation_cancelled(tiny_server, path, body):
    """A real client sends a long generation (8 x 900 tokens), then closes its connection once the engine runs
    it: the engine drops the sequences long before they would finish."""
    engine = tiny_server.engine
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "an idle engine")
    n, max_tokens = 8, 900
    before = engine.stats["generated_tokens"]
    request = {"model": "tiny-random", "n": n, "max_tokens": max_tokens, "ignore_eos": True, "seed": 1, **body}
    _, writer = await asyncio.open_connection(*tiny_server.url.removeprefix("http://").split(":"))
    writer.write(_raw_request(path, request))
    await writer.drain()
    await wait_until(lambda: engine.activity()["running"] == n, 30, "the request's sequences to run")
    writer.close()
    await writer.wait_closed()
    await wait_until(lambda: engine.activity() == {"waiting": 0, "running": 0}, 30, "the engine to drop them")
    generated = engine.stats["generated_tokens"] - before
    assert generated < n * max_tokens / 2, f"{generated} of {n * max_tokens} tokens were generated"


def test_an_idle_connection_outlives_the_clients_keep_alive(tiny_server):
    assert_keeps_idle_connections(tiny_server.url)


def test_a_started_server_has_its_heap_frozen(tiny_server):
    """A full garbage collection skips what existed when the server started (the model, the libraries): it would
    otherwise stop every thread, the engine's included, for a walk over all of it."""
    import gc

    assert gc.get_freeze_count() > 10_000
