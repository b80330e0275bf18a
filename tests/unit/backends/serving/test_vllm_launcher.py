"""The vLLM launcher against a fake `vllm` executable (vLLM itself needs a GPU): flags, environment, health wait,
log tail on failure, SIGTERM shutdown, and the dialect client's adapter calls."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import openai
import pytest

from backends.serving.inference_client import InferenceClient, InferenceError
from backends.serving.vllm import VLLMConfig, VLLMServer, VLLMStartError, build_command

FAKE_VLLM = textwrap.dedent('''
    import argparse, json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    record = os.environ["FAKE_VLLM_RECORD"]
    p = argparse.ArgumentParser()
    p.add_argument("command"); p.add_argument("model")
    for flag in ("--host", "--port", "--served-model-name", "--max-lora-rank", "--max-loras", "--max-cpu-loras",
                 "--tool-call-parser", "--logprobs-mode", "--gpu-memory-utilization", "--max-model-len", "--dtype",
                 "--seed"):
        p.add_argument(flag)
    p.add_argument("--enable-lora", action="store_true"); p.add_argument("--enable-auto-tool-choice", action="store_true")
    args = p.parse_args()
    state = {"argv": sys.argv[1:], "args": vars(args), "loads": [], "unloads": [],
             "env": {k: os.environ.get(k) for k in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_API_KEY")}}
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


def _config(script, tmp_path, **kw) -> VLLMConfig:
    return VLLMConfig(model="/models/qwen", served_model_name="qwen", port=0, executable=str(script),
                      log_path=str(tmp_path / "vllm.log"), startup_timeout_s=20, **kw)


def test_command_has_the_flags_the_dialect_needs():
    cmd = build_command(VLLMConfig(model="m", max_lora_rank=32, max_loras=2, max_model_len=4096,
                                   extra_args=["--seed", "1"], api_key="secret"), 8123)
    assert cmd[:3] == ["vllm", "serve", "m"]
    for flag, value in [("--max-lora-rank", "32"), ("--max-loras", "2"), ("--tool-call-parser", "hermes"),
                        ("--port", "8123"), ("--host", "127.0.0.1"), ("--max-model-len", "4096"),
                        ("--logprobs-mode", "raw_logprobs"), ("--gpu-memory-utilization", "0.85")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-lora" in cmd and "--enable-auto-tool-choice" in cmd and cmd[-2:] == ["--seed", "1"]
    assert "secret" not in " ".join(cmd)  # the key travels in VLLM_API_KEY, never on the command line
    assert "secret" not in repr(VLLMConfig(model="m", api_key="secret"))


async def test_launch_serve_adapters_and_sigterm(fake_vllm, tmp_path):
    script, record = fake_vllm
    server = VLLMServer(_config(script, tmp_path, api_key="k3y", max_loras=3))
    server.start()
    try:
        state = json.loads(record.read_text())
        args = state["args"]
        assert args["command"] == "serve" and args["model"] == "/models/qwen" and args["enable_lora"]
        assert args["max_loras"] == "3" and args["enable_auto_tool_choice"] and args["tool_call_parser"] == "hermes"
        assert int(args["port"]) == server.port and server.port != 0
        assert state["env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": "k3y"}

        client = server.client()
        assert await client.health()
        await client.load_adapter("qwen@1", "/adapters/step-1")
        assert await client.models() == ["qwen", "qwen@1"]
        oa = openai.AsyncOpenAI(base_url=server.base_url, api_key="k3y", max_retries=0)
        reply = await oa.chat.completions.create(model="qwen@1", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == [7, 2] and reply.prompt_token_ids == [1, 2, 3]
        await oa.close()
        await client.unload_adapter("qwen@1")
        with pytest.raises(InferenceError) as e:
            await client.unload_adapter("qwen@1")
        assert e.value.status == 404
        with pytest.raises(InferenceError) as e:
            await InferenceClient(server.base_url, api_key="wrong").models()
        assert e.value.status == 401
        state = json.loads(record.read_text())
        assert state["loads"] == [{"lora_name": "qwen@1", "lora_path": "/adapters/step-1"}]
        assert state["unloads"] == [{"lora_name": "qwen@1"}]
    finally:
        code = server.stop(grace_s=10)
    assert code == 0 and json.loads(record.read_text())["sigterm"]
    assert not await server.client(timeout=1).health()

    attached = VLLMServer.attach(server.base_url)
    assert attached.url == server.url and attached.stop() is None


def test_a_crash_raises_with_the_log_tail(fake_vllm, tmp_path, monkeypatch):
    script, _ = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    with pytest.raises(VLLMStartError) as e:
        VLLMServer(_config(script, tmp_path, api_key="hidden-key")).start()
    message = str(e.value)
    assert "exited with code 3" in message and "CUDA out of memory" in message and "fake vllm starting" in message


def test_no_health_by_the_deadline_kills_it_and_shows_the_log(fake_vllm, tmp_path, monkeypatch):
    script, _ = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    config = _config(script, tmp_path).model_copy(update={"startup_timeout_s": 1.5, "stop_grace_s": 1})
    server = VLLMServer(config)
    with pytest.raises(VLLMStartError) as e:
        server.start()
    assert "within 1.5 s" in str(e.value) and "fake vllm starting" in str(e.value)
    assert server.process is None  # SIGTERM was ignored: the group got SIGKILL


def test_missing_executable_is_a_clear_error(tmp_path):
    with pytest.raises(VLLMStartError) as e:
        VLLMServer(_config(tmp_path / "nope", tmp_path)).start()
    assert "is vLLM installed" in str(e.value)


def test_api_key_is_masked_in_the_log_tail(tmp_path):
    from backends.serving.vllm import log_tail

    log = tmp_path / "x.log"
    log.write_text("a\nkey=topsecret\n")
    assert "topsecret" not in log_tail(log, secret="topsecret")


def test_no_process_left_behind(fake_vllm, tmp_path):
    script, _ = fake_vllm
    server = VLLMServer(_config(script, tmp_path)).start()
    pid = server.process.pid
    server.stop(grace_s=10)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
