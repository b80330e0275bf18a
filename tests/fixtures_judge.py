"""Judge fixtures: a real local HTTP server that answers like an OpenAI endpoint with scripted replies.

``judge_server.script(reply, reply, ...)`` queues what the next chat requests get, one each:
a string (a 200 chat completion with that content), ``Reply(status, body)`` (anything else), or a
callable ``f(request_json) -> str | Reply``. ``judge_server.requests`` holds every request received
(path and JSON body), so tests count calls at the server. ``LocalHTTPServer`` is the stdlib threaded
server underneath, reused by the Langfuse sink in ``test_tracing.py``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Reply:
    status: int = 200
    body: Any = field(default_factory=dict)
    raw: bytes | None = None  # sent as is (content-type application/x-protobuf) when set


class LocalHTTPServer:
    """A threaded HTTP server on 127.0.0.1:<ephemeral>; subclasses implement ``handle``."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                request = {"method": method, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "raw": raw}
                try:
                    request["json"] = json.loads(raw) if raw else None
                except ValueError:
                    request["json"] = None
                with owner._lock:
                    owner.requests.append(request)
                reply = owner.handle(request)
                payload = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/x-protobuf" if reply.raw is not None else "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):  # noqa: N802
                self._serve("GET")

            def do_POST(self):  # noqa: N802
                self._serve("POST")

            def log_message(self, *args):  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def handle(self, request: dict[str, Any]) -> Reply:  # pragma: no cover - overridden
        return Reply(404, {"error": "not found"})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def completion(content: str, model: str = "judge-model") -> dict[str, Any]:
    """The body of a chat completion whose single choice says ``content``."""
    return {
        "id": "chatcmpl-judge",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
    }


ScriptItem = str | Reply | Callable[[dict[str, Any]], "str | Reply"]


class ScriptedOpenAIServer(LocalHTTPServer):
    """Answers ``POST /v1/chat/completions`` from a script; anything unscripted gets a 500."""

    def __init__(self) -> None:
        self._script: list[ScriptItem] = []
        super().__init__()

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def script(self, *items: ScriptItem) -> ScriptedOpenAIServer:
        with self._lock:
            self._script.extend(items)
        return self

    def reset(self) -> None:
        """Forget the requests received and any unused script."""
        with self._lock:
            self._script.clear()
            self.requests.clear()

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    def handle(self, request: dict[str, Any]) -> Reply:
        if not request["path"].endswith("/chat/completions"):
            return Reply(404, {"error": {"message": f"no route {request['path']}"}})
        with self._lock:
            item = self._script.pop(0) if self._script else None
        if item is None:
            return Reply(500, {"error": {"message": "script exhausted"}})
        if callable(item) and not isinstance(item, Reply):
            item = item(request["json"])
        if isinstance(item, str):
            return Reply(200, completion(item, (request["json"] or {}).get("model", "judge-model")))
        return item


@pytest.fixture
def judge_server():
    server = ScriptedOpenAIServer()
    try:
        yield server
    finally:
        server.close()


SYSTEM_PROMPT = "You are a calculator agent. Answer the user's arithmetic question with a number."
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}


def make_group(answers: list[str], rewards: list[float] | None = None, scenario_id: str = "sum-1"):
    """A group of plain-chat trajectories that share system prompt and question, differing in the answer."""
    from agents import Trajectory, TrajectoryGroup

    rewards = rewards if rewards is not None else [float(i) for i in range(len(answers))]
    return TrajectoryGroup(
        [
            Trajectory(
                messages_and_choices=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": answer},
                ],
                reward=reward,
            )
            for answer, reward in zip(answers, rewards)
        ],
        scenario_id=scenario_id,
    )


def scores_json(scores: dict[str, float]) -> str:
    return json.dumps({"scores": [{"id": k, "explanation": f"reason {k}", "score": v} for k, v in scores.items()]})


def answer_key_judge(correct: str):
    """A scripted judge that reads the prompt: 1.0 to trajectories whose last assistant line is ``correct``.

    It answers in reverse id order, so a caller matching by position would get every score wrong.
    """
    import re

    def reply(body: dict[str, Any]) -> str:
        prompt = body["messages"][-1]["content"]
        blocks = re.findall(r'<trajectory id="(t\d+)">\n(.*?)</trajectory>', prompt, re.DOTALL)
        scores = {}
        for tid, block in blocks:
            answers = re.findall(r"^\[assistant\] (.*)$", block, re.MULTILINE)
            scores[tid] = 1.0 if answers and answers[-1].strip() == correct else 0.0
        return scores_json(dict(reversed(list(scores.items()))))

    return reply
