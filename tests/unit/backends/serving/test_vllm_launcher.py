"""The vLLM launcher against a fake `vllm` executable (vLLM itself needs a GPU): flags, environment, health wait,
log tail on failure, SIGTERM shutdown, and the dialect client's adapter calls."""

from __future__ import annotations

import json
import os

import openai
import pytest

from backends.serving.inference_client import InferenceClient, InferenceError
from backends.serving.vllm import (RUNTIME_LORA_ENV, VLLMConfig, VLLMServer, VLLMStartError, build_command,
                                   describe_env, vllm_environment)

def _config(script, tmp_path, **kw) -> VLLMConfig:
    return VLLMConfig(model="/models/qwen", served_model_name="qwen", port=0, executable=[str(script)],
                      log_path=str(tmp_path / "vllm.log"), startup_timeout_s=20, **kw)


# `vllm serve` exactly as it ran on the H200 (benchmarks/results/inference-vllm-h200.md), vLLM 0.26.0.
H200_COMMAND = ("vllm serve /models/qwen --host 127.0.0.1 --port 8000 --served-model-name base --enable-lora "
                "--max-lora-rank 16 --max-loras 4 --enable-auto-tool-choice --tool-call-parser hermes --logprobs-mode "
                "raw_logprobs --gpu-memory-utilization 0.8 --max-model-len 2048 --dtype bfloat16").split()


def test_command_is_the_one_that_ran_on_the_h200():
    cfg = VLLMConfig(model="/models/qwen", served_model_name="base", max_lora_rank=16, max_loras=4,
                     gpu_memory_utilization=0.8, max_model_len=2048, dtype="bfloat16")
    assert build_command(cfg, 8000) == H200_COMMAND
    wrapped = cfg.model_copy(update={"executable": ["python3", "-m", "vllm.entrypoints.cli.main"]})
    assert build_command(wrapped, 8000) == ["python3", "-m", "vllm.entrypoints.cli.main", *H200_COMMAND[1:]]
    assert VLLMConfig(model="m", executable="/opt/vllm env/bin/x 'a b'").executable == ["/opt/vllm", "env/bin/x",
                                                                                          "a b"]


def test_environment_is_the_one_that_ran_on_the_h200():
    cfg = VLLMConfig(model="m", api_key="k", env={"PYTHONPATH": None, "VLLM_SITE": "/s"})
    base = {"PATH": "/bin", "PYTHONPATH": "/flow", "VLLM_API_KEY": "stale", RUNTIME_LORA_ENV: "False"}
    assert vllm_environment(cfg, base) == {"PATH": "/bin", "VLLM_SITE": "/s", RUNTIME_LORA_ENV: "True",
                                           "VLLM_API_KEY": "k"}
    assert "VLLM_API_KEY" not in vllm_environment(VLLMConfig(model="m"), base)
    shown = describe_env({"HF_TOKEN": "hf_x", "MY_API_KEY": "s", "VLLM_SITE": "/s", "PYTHONPATH": None})
    assert shown == "HF_TOKEN=*** MY_API_KEY=*** VLLM_SITE=/s PYTHONPATH=(removed)"


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
