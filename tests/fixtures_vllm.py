"""A fake `vllm` executable for the CPU: parses `vllm serve`'s flags, records its argv, arguments and watched
environment variables (the two it always records plus FAKE_VLLM_WATCH's comma-separated names) in
$FAKE_VLLM_RECORD, and speaks vLLM's dialect (health, models, adapters, chat completions with token ids).
FAKE_VLLM_MODE=crash exits at start with an out-of-memory line; =hang never answers and ignores SIGTERM;
=die_on_chat serves until the first chat completion, then prints an engine error and exits with code 9."""

from __future__ import annotations

import stat
import sys
import textwrap

import pytest

FAKE_VLLM = textwrap.dedent('''
    import argparse, json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    record = os.environ["FAKE_VLLM_RECORD"]
    p = argparse.ArgumentParser()
    p.add_argument("command"); p.add_argument("model")
    for flag in ("--host", "--port", "--served-model-name", "--max-lora-rank", "--max-loras", "--max-cpu-loras",
                 "--tool-call-parser", "--logprobs-mode", "--gpu-memory-utilization", "--max-model-len", "--dtype",
                 "--seed", "--chat-template"):
        p.add_argument(flag)
    p.add_argument("--enable-lora", action="store_true"); p.add_argument("--enable-auto-tool-choice", action="store_true")
    args = p.parse_args()
    watched = ["VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_API_KEY"]
    watched += [n for n in os.environ.get("FAKE_VLLM_WATCH", "").split(",") if n]
    state = {"argv": sys.argv[1:], "args": vars(args), "loads": [], "unloads": [],
             "env": {k: os.environ.get(k) for k in watched}}
    def save():
        with open(record, "w") as f: json.dump(state, f)
    save()
    print("INFO fake vllm starting", args.model, flush=True)
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    if mode == "crash":
        print("ERROR CUDA out of memory while loading weights", flush=True); sys.exit(3)
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)
    key = os.environ.get("VLLM_API_KEY")
    names = [args.served_model_name]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, code, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code); self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        def authorised(self):
            if key and self.headers.get("Authorization") != "Bearer " + key:
                self.reply(401, {"error": "Unauthorized"}); return False
            return True
        def do_GET(self):
            if self.path == "/health": return self.reply(200, "", "text/plain")
            if not self.authorised(): return
            if self.path == "/v1/models":
                return self.reply(200, {"object": "list", "data": [{"id": n, "object": "model"} for n in names]})
            self.reply(404, {"error": {"message": "no route", "type": "NotFound", "code": 404}})
        def do_POST(self):
            if not self.authorised(): return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/load_lora_adapter":
                state["loads"].append(body); save(); names.append(body["lora_name"])
                return self.reply(200, "Success: LoRA adapter added successfully.", "text/plain")
            if self.path == "/v1/unload_lora_adapter":
                if body["lora_name"] not in names:
                    return self.reply(404, {"error": {"message": "The lora adapter cannot be found.", "code": 404}})
                state["unloads"].append(body); save(); names.remove(body["lora_name"])
                return self.reply(200, "Success", "text/plain")
            if self.path == "/v1/chat/completions" and mode == "die_on_chat":
                print("ERROR EngineCore died: CUDA error: an illegal memory access", flush=True); os._exit(9)
            if self.path == "/v1/chat/completions":
                if body["model"] not in names:
                    return self.reply(404, {"error": {"message": "model not found", "type": "NotFoundError",
                                                      "code": 404}})
                return self.reply(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "prompt_token_ids": [1, 2, 3],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                                 "logprobs": None, "token_ids": [7, 2]}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            self.reply(404, {"error": {"message": "no route", "code": 404}})

    server = ThreadingHTTPServer((args.host, int(args.port)), H)
    def stop(*_):
        state["sigterm"] = True; save(); os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\n" + FAKE_VLLM)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return script, record


