"""An instant OpenAI-compatible policy for measuring orchestration overhead (no model, no GPU).

A raw ASGI app on uvicorn (asyncio, no per-request threads) answers every chat completion at once with
a fixed short answer, made-up token ids and logprobs in the dialect's fields, answers text completions
(the publish probe's token-id prompts) the same way in the completions format, loads/unloads any adapter
name, and counts requests. Used by ``benchmarks/orchestration.py`` so that a step's time is all
orchestration and storage.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time


class StubPolicyServer:
    def __init__(self, answer: str = "<answer>4</answer>", tokens: int = 8, prompt_tokens: int = 19,
                 record: bool = False, latency_s: float = 0.0):
        import uvicorn

        self.answer, self.tokens, self.prompt_tokens = answer, tokens, prompt_tokens
        self.requests = 0
        self.record = record
        self.latency_s = latency_s  # each chat completion waits this long (asleep): generation time without the CPU
        self.chat_requests: list[tuple[dict, dict]] = []  # (headers, body) of each chat completion, when recording
        self.clients: set[tuple] = set()  # the (host, port) of every connection a chat completion came on
        self.adapters: set[str] = set()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.base_url = self.url + "/v1"
        self._server = uvicorn.Server(uvicorn.Config(self._app, log_level="warning", lifespan="off", interface="asgi3"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)

    def _answer(self, path: str, body: dict) -> dict:
        if path.endswith("/load_lora_adapter"):
            self.adapters.add(body["lora_name"])
            return {"status": "ok"}
        if path.endswith("/unload_lora_adapter"):
            self.adapters.discard(body.get("lora_name"))
            return {"status": "ok"}
        self.requests += 1
        prompt_ids = list(range(1, self.prompt_tokens + 1))
        n, seed = int(body.get("n") or 1), int(body.get("seed") or 0)
        k = min(self.tokens, int(body.get("max_tokens") or self.tokens))
        if not path.endswith("/chat/completions"):
            return self._text_completion(body, k)
        choices = [{
            "index": i, "finish_reason": "stop",
            "message": {"role": "assistant", "content": self.answer},
            "token_ids": [(seed + i + j) % 400 + 3 for j in range(k)],
            "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                     for _ in range(k)]},
        } for i in range(n)]
        return {"id": "stub", "object": "chat.completion", "created": int(time.time()), "model": body.get("model"),
                "prompt_token_ids": prompt_ids, "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": k * n,
                          "total_tokens": len(prompt_ids) + k * n}}

    def _text_completion(self, body: dict, k: int) -> dict:
        """``/v1/completions`` in the completions format: made-up tokens, each with logprob -0.5."""
        ids = [(j % 400) + 3 for j in range(k)]
        top = [{f"token_id:{i}": -0.5} for i in ids]
        return {"id": "stub", "object": "text_completion", "created": int(time.time()), "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "length", "text": self.answer, "token_ids": ids,
                             "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * k,
                                          "top_logprobs": top, "text_offset": list(range(k))}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": k, "total_tokens": k}}

    async def _app(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"].endswith("/chat/completions"):
            self.clients.add(tuple(scope.get("client") or ()))
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if self.record and path.endswith("/chat/completions"):
            self.chat_requests.append(({k.decode(): v.decode() for k, v in scope["headers"]}, json.loads(raw)))
        if scope["method"] == "GET":
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "stub"}
                    for m in ["stub-base", *sorted(self.adapters)]]
            payload = {"status": "ok"} if path.startswith("/health") else {"object": "list", "data": data}
        else:
            payload = self._answer(path, json.loads(raw or b"{}"))
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
