"""Agent fixtures: a scripted OpenAI-compatible HTTP server that plays the policy's part exactly.

`scripted_server` is a real stdlib HTTP server on 127.0.0.1:<free port> answering ``POST
/v1/chat/completions`` in the OpenAI/vLLM shape (message, finish_reason, per-token logprobs, ``token_ids``
and ``prompt_token_ids``). Its replies come from a script: set ``server.replies`` to a list of replies
(consumed in order) or ``server.responder`` to a function of the request body. A reply is a string (the
content), or a dict with ``content`` and/or ``tool_calls`` as ``[(name, arguments)]`` where arguments is
a dict or a raw (possibly broken) JSON string. Every request body is kept in ``server.requests``.
Token ids are the UTF-8 bytes of the reply, each with logprob -0.25: enough for a trajectory to be
trainable-shaped, and nothing a test needs to look at.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest


def _message(reply: str | dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """(assistant message, finish_reason, text behind its tokens) of a scripted reply."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}, "stop", reply
    calls = []
    for i, (name, args) in enumerate(reply.get("tool_calls") or []):
        raw = args if isinstance(args, str) else json.dumps(args)
        calls.append({"id": f"call_{i}_{name}", "type": "function", "function": {"name": name, "arguments": raw}})
    msg: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if calls:
        msg["tool_calls"] = calls
    text = (reply.get("content") or "") + "".join(c["function"]["arguments"] for c in calls)
    return msg, reply.get("finish_reason", "tool_calls" if calls else "stop"), text


class ScriptedServer:
    """The server's state: its script, the requests it saw, and its address."""

    def __init__(self) -> None:
        self.replies: list[str | dict[str, Any]] = []
        self.responder: Callable[[dict[str, Any]], str | dict[str, Any]] | None = None
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.base_url = ""

    def next_reply(self, body: dict[str, Any]) -> str | dict[str, Any]:
        with self.lock:
            self.requests.append(body)
            if self.responder is not None:
                return self.responder(body)
            if not self.replies:
                raise AssertionError(f"scripted server has no reply left for request {len(self.requests)}")
            return self.replies.pop(0)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        msg, finish, text = _message(self.next_reply(body))
        ids = list(text.encode()) or [0]
        logprobs = [{"token": f"token_id:{i}", "logprob": -0.25, "bytes": [i], "top_logprobs": []} for i in ids]
        prompt_ids = list(range(1, 1 + 3 * len(body.get("messages") or [])))
        return {
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": {"content": logprobs},
                         "token_ids": ids}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
        }


def _handler(state: ScriptedServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                return
            try:
                self._send(200, state.completion(body))
            except AssertionError as exc:
                self._send(500, {"error": {"message": str(exc), "type": "script_exhausted"}})

    return Handler


@pytest.fixture
def scripted_server():
    """A running ScriptedServer; stopped after the test."""
    state = ScriptedServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-openai",
                              daemon=True)
    thread.start()
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture
async def scripted_client(scripted_server):
    """The trajflow policy client (a real openai.AsyncOpenAI) pointed at the scripted server."""
    from agents.client import policy_client

    client = policy_client(scripted_server.base_url, max_retries=0, timeout=30)
    yield client
    await client.close()
