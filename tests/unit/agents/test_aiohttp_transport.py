"""The policy client's aiohttp transport against a real HTTP/1.1 server on a socket: answers, streamed and compressed
bodies, connection reuse, and each failure raised as the httpx error the openai client and the replica router know."""

import asyncio
import gzip
import json
import socket
import threading

import httpx
import openai
import pytest

from agents.aiohttp_transport import AiohttpTransport
from agents.client import policy_client, shared_ssl_context

CHAT = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"},
                     "token_ids": [7], "logprobs": {"content": [{"token": "4", "logprob": -0.1, "bytes": None,
                                                                 "top_logprobs": []}]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


class RawServer:
    """HTTP/1.1 with keep-alive on a thread's event loop; the path picks the behaviour. Counts connections."""

    def __init__(self):
        self.connections = 0
        self.requests: list[dict] = []
        self.loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        ready = threading.Event()

        async def serve():
            self.server = await asyncio.start_server(self._connection, sock=sock)
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(serve()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _connection(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *header_lines = head.decode().split("\r\n")
                method, path, _ = line.split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
                if "/hang-up/" in path:
                    writer.close()
                    return
                if "/slow/" in path:
                    await asyncio.sleep(5)
                if path.endswith("/stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n")
                    for part in (b"one ", b"two ", b"three"):
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                        await writer.drain()
                        await asyncio.sleep(0.01)
                    writer.write(b"0\r\n\r\n")
                    continue
                payload, extra = json.dumps(CHAT).encode(), b""
                if path.endswith("/gzip"):
                    payload, extra = gzip.compress(payload), b"content-encoding: gzip\r\n"
                if "/cookie/" in path:
                    extra = b"set-cookie: session=abc; Path=/\r\n"
                status = b"404 Not Found" if path.endswith("/missing") else b"200 OK"
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
                             % (status, extra, len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    def stop(self):
        async def shut():
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def raw_server():
    server = RawServer()
    yield server
    server.stop()


def _free_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def test_chat_calls_reuse_connections_and_carry_the_dialect_fields(raw_server):
    async def main():
        client = policy_client(raw_server.url + "/v1", api_key="k", max_retries=0)
        try:
            for _ in range(2):  # one after another: the second reuses the first's connection
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2"}])
            answers = await asyncio.gather(*(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "2+2"}]) for _ in range(8)))
        finally:
            await client.close()
        return answers

    answers = asyncio.run(main())
    assert [a.choices[0].message.content for a in answers] == ["4"] * 8
    assert answers[0].choices[0].model_extra["prompt_token_ids"] == [1, 2]  # copied onto the choice
    assert raw_server.connections <= 8  # 10 calls; 8 at once need 8 connections, the first two shared one
    first = raw_server.requests[0]
    body = json.loads(first["body"])
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert first["headers"]["authorization"] == "Bearer k"
    assert first["headers"]["content-length"] == str(len(first["body"]))


def test_streamed_and_compressed_bodies_read_as_httpx_reads_them(raw_server):
    async def main():
        async with httpx.AsyncClient(transport=AiohttpTransport(16, shared_ssl_context())) as http:
            async with http.stream("GET", raw_server.url + "/stream") as response:
                chunks = [c async for c in response.aiter_bytes()]
            unzipped = await http.get(raw_server.url + "/gzip")
            missing = await http.get(raw_server.url + "/missing")
        return chunks, unzipped, missing

    chunks, unzipped, missing = asyncio.run(main())
    assert b"".join(chunks) == b"one two three" and len(chunks) >= 2
    assert unzipped.json()["id"] == "c"
    assert missing.status_code == 404 and missing.reason_phrase == "Not Found"


@pytest.mark.parametrize("where, httpx_error, openai_error", [
    ("refused", httpx.ConnectError, openai.APIConnectionError),
    ("hang-up", httpx.RemoteProtocolError, openai.APIConnectionError),
    ("slow", httpx.ReadTimeout, openai.APITimeoutError),
])
def test_failures_are_the_httpx_errors_of_the_same_meaning(raw_server, where, httpx_error, openai_error):
    base = _free_port_url() if where == "refused" else f"{raw_server.url}/{where}"

    async def raw():
        transport = AiohttpTransport(4, shared_ssl_context())
        request = httpx.Request("POST", f"{base}/chat/completions", json={"model": "m"},
                                extensions={"timeout": {"connect": 2, "read": 0.3, "write": 2, "pool": 2}})
        try:
            await transport.handle_async_request(request)
        finally:
            await transport.aclose()

    async def through_openai():
        client = policy_client(f"{base}/v1" if where != "slow" else f"{raw_server.url}/slow", timeout=0.3,
                               max_retries=0)
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        finally:
            await client.close()

    with pytest.raises(httpx_error):
        asyncio.run(raw())
    with pytest.raises(openai_error):
        asyncio.run(through_openai())


def test_cookies_an_answer_sets_go_with_later_requests(raw_server):
    async def main():
        client = policy_client(raw_server.url + "/v1", api_key="k", max_retries=0)
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2"}])
            await client.post(raw_server.url + "/cookie/v1/chat/completions", cast_to=object,
                              body={"model": "m", "messages": []})
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2"}])
        finally:
            await client.close()
        return dict(client._client.cookies)

    cookies = asyncio.run(main())
    assert cookies == {"session": "abc"}
    assert [r["headers"].get("cookie") for r in raw_server.requests] == [None, None, "session=abc"]
