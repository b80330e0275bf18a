"""An instant OpenAI-compatible policy for measuring orchestration overhead (no model, no GPU).

It answers every chat completion at once with a fixed short answer, made-up token ids and logprobs
in the dialect's fields, loads/unloads any adapter name, and counts requests. Used by
``benchmarks/orchestration.py`` so that a step's time is all orchestration and storage.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubPolicyServer:
    def __init__(self, answer: str = "<answer>4</answer>", tokens: int = 8):
        self.answer, self.tokens = answer, tokens
        self.requests = 0
        self.adapters: set[str] = set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, payload) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path.startswith("/health"):
                    return self._send(200, {"status": "ok"})
                data = [{"id": m, "object": "model", "created": 0, "owned_by": "stub"}
                        for m in ["stub-base", *sorted(stub.adapters)]]
                return self._send(200, {"object": "list", "data": data})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                if self.path.endswith("/load_lora_adapter"):
                    stub.adapters.add(body["lora_name"])
                    return self._send(200, {"status": "ok"})
                if self.path.endswith("/unload_lora_adapter"):
                    stub.adapters.discard(body.get("lora_name"))
                    return self._send(200, {"status": "ok"})
                stub.requests += 1
                prompt_ids = list(range(1, 20))
                n = int(body.get("n") or 1)
                seed = int(body.get("seed") or 0)
                k = min(stub.tokens, int(body.get("max_tokens") or stub.tokens))
                choices = [{
                    "index": i, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": stub.answer},
                    "token_ids": [(seed + i + j) % 400 + 3 for j in range(k)],
                    "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                             for _ in range(k)]},
                } for i in range(n)]
                return self._send(200, {
                    "id": "stub", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model"), "prompt_token_ids": prompt_ids, "choices": choices,
                    "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": k * n,
                              "total_tokens": len(prompt_ids) + k * n},
                })

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.base_url = self.url + "/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
