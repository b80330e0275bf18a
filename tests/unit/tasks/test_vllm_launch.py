"""The run's `vllm serve` as the flow starts it (tasks/support/runtime.py), against the fake `vllm` executable:
trajflow's model names become the local folder vLLM can load, `inference.vllm_command` and `inference.vllm_env`
reach the process, port 0 is a free port, and bad settings fail in one line."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from backends.modeling.loading import ensure_tiny_random
from tasks.run_config import RunConfig, load_config
from tasks.support.runtime import Runtime
from tasks.support.vllm_launch import vllm_config
from tests.paths import REPO

TINY = REPO / "configs" / "tiny.yaml"


def _config(tmp_path, *overrides: str) -> RunConfig:
    return load_config(TINY, [f"storage={tmp_path / 'runs'}", "inference.backend=vllm", *overrides])


def _served(config: RunConfig) -> Runtime:
    rt = Runtime(config)
    rt.ensure_server()
    return rt


def test_the_model_alias_reaches_vllm_as_the_local_folder(fake_vllm, tmp_path):
    script, record = fake_vllm
    rt = _served(_config(tmp_path, f"inference.vllm_command=[{script}]"))
    try:
        args = json.loads(record.read_text())["args"]
        assert args["model"] == str(ensure_tiny_random())  # the folder the embedded engine loads, not 'tiny-random'
        assert args["served_model_name"] == "tiny-random"  # the base name the embedded engine serves
        assert int(args["port"]) == rt._servers[0].port != 8000  # inference.port 0: a free port
    finally:
        rt.close()


def test_vllm_command_and_env_reach_the_process_and_secrets_stay_out_of_the_log(fake_vllm, tmp_path, monkeypatch,
                                                                                  caplog):
    script, record = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_WATCH", "PYTHONPATH,VLLM_SITE,HF_TOKEN")
    monkeypatch.setenv("PYTHONPATH", "/the/flows/site")
    monkeypatch.setenv("HF_TOKEN", "hf_verysecretvalue")
    command = f"{sys.executable} {script}"  # a string is split like a shell would
    env = '{PYTHONPATH: null, VLLM_SITE: /opt/vllm-site}'
    with caplog.at_level(logging.INFO, logger="trajflow"):
        rt = _served(_config(tmp_path, f"inference.vllm_command={command}", f"inference.vllm_env={env}"))
        rt.close()
    state = json.loads(record.read_text())
    assert state["env"]["PYTHONPATH"] is None and state["env"]["VLLM_SITE"] == "/opt/vllm-site"
    assert state["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"

    with caplog.at_level(logging.INFO, logger="trajflow"):
        rt = _served(_config(tmp_path, f"inference.vllm_command=[{script}]", "inference.vllm_env=[HF_TOKEN]"))
        rt.close()
    assert json.loads(record.read_text())["env"]["HF_TOKEN"] == "hf_verysecretvalue"
    assert "hf_verysecretvalue" not in caplog.text and "HF_TOKEN=***" in caplog.text
    assert "VLLM_SITE=/opt/vllm-site" in caplog.text and "starting vLLM" in caplog.text


def test_the_default_command_is_vllm_on_path(tmp_path):
    config = _config(tmp_path)
    assert config.inference.vllm_command == ["vllm"] and config.inference.vllm_env == {}
    assert vllm_config(config, None).executable == ["vllm"]


@pytest.mark.parametrize("overrides, error", [
    (["inference.vllm_command=[]"], "must name an executable"),
    (["inference.vllm_command=''"], "must name an executable"),
    (["inference.vllm_env=[TRAJFLOW_NOT_SET_ANYWHERE]"], "TRAJFLOW_NOT_SET_ANYWHERE, not set in the flow's"),
    (["base_model=/no/such/model"], "unknown model '/no/such/model'"),
])
def test_bad_vllm_settings_fail_in_one_line(tmp_path, overrides, error):
    with pytest.raises(ValueError) as e:
        vllm_config(_config(tmp_path, *overrides), None)
    assert error in str(e.value)


def test_vllm_dying_mid_rollouts_fails_the_task_clearly_and_the_retry_restarts_it(fake_vllm, tmp_path, monkeypatch):
    from storage.layout import group_file, GROUPS_DIR
    from tasks.rollouts import run_rollouts_fn
    from tasks.scenarios import sample_scenarios_fn
    from tasks.support.retry_policy import TransientError, is_transient
    from tasks.support.runtime import close_runtime, get_runtime
    from tasks.training import initialize_policy_fn

    script, record = fake_vllm
    config = _config(tmp_path, f"inference.vllm_command=[{script}]", "rollouts.timeout_s=20")
    initialize_policy_fn(config)  # the step-0 adapter in storage, which the rollouts of step 1 sample from
    monkeypatch.setenv("FAKE_VLLM_MODE", "die_on_chat")
    rt = get_runtime(config)
    try:
        rt.ensure_server()
        first_pid = rt._servers[0].process.pid
        monkeypatch.setenv("FAKE_VLLM_MODE", "ok")  # the restarted vLLM is healthy
        scenarios = sample_scenarios_fn(config, 1)
        with pytest.raises(TransientError) as e:
            run_rollouts_fn(config, 1, scenarios)
        message = str(e.value)
        assert is_transient(e.value)  # so Prefect's retry (tasks/rollouts.py: retries=3) runs the task again
        assert f"vLLM (pid {first_pid}" in message and "exited with code 9" in message
        assert "EngineCore died: CUDA error" in message  # the log tail

        result = run_rollouts_fn(config, 1, scenarios)  # the retry: vLLM restarted, the policy reloaded
        assert rt._servers[0].process.pid != first_pid and rt.server_failure() is None
        assert result["failed_rollouts"] == 0 and result["ran_groups"] == len(scenarios)
        assert all(rt.store.exists(1, group_file(GROUPS_DIR, i)) for i in range(len(scenarios)))
        loads = json.loads(record.read_text())["loads"]
        assert [load["lora_name"] for load in loads] == [config.policy(0)]
    finally:
        close_runtime(config)


CHATML_WITHOUT_TOOLS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_vllm_gets_the_tool_template_where_the_models_own_ignores_tools(fake_vllm, tmp_path):
    """SmolLM2's ChatML template drops `tools`; the embedded server renders them with TOOL_CHAT_TEMPLATE, so vLLM is
    given the same template as --chat-template (on the H200 the SFT'd research policy made no tool call without)."""
    import shutil

    from transformers import AutoTokenizer

    from backends.modeling.chat_render import render_chat
    from backends.modeling.loading import TOOL_CHAT_TEMPLATE
    from backends.serving.vllm import build_command

    script, record = fake_vllm
    chatml = tmp_path / "chatml-model"
    shutil.copytree(ensure_tiny_random(), chatml)
    tok = AutoTokenizer.from_pretrained(str(chatml))
    tok.chat_template = CHATML_WITHOUT_TOOLS
    tok.save_pretrained(str(chatml))

    rt = _served(_config(tmp_path, f"inference.vllm_command=[{script}]", f"base_model={chatml}"))
    rt.close()
    template = json.loads(record.read_text())["args"]["chat_template"]
    assert template and open(template).read() == TOOL_CHAT_TEMPLATE
    # the prompt vLLM renders from that file is the embedded server's, tools included
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "find it"}]
    ours = render_chat(AutoTokenizer.from_pretrained(str(chatml)), messages, tools, add_generation_prompt=True)
    theirs = tok.apply_chat_template(messages, tools=tools, chat_template=open(template).read(),
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ours == list(theirs) and "search" in tok.decode(ours)

    rt = _served(_config(tmp_path, f"inference.vllm_command=[{script}]"))  # tiny-random's own template has tools
    rt.close()
    assert json.loads(record.read_text())["args"]["chat_template"] is None

    config = _config(tmp_path, f"inference.vllm_command=[{script}]", f"base_model={chatml}")
    cfg = vllm_config(config, None).model_copy(update={"extra_args": ["--chat-template", "/users/own.jinja"]})
    argv = build_command(cfg, 8000)
    assert argv.count("--chat-template") == 1 and argv[-1] == "/users/own.jinja"  # the user's own flag wins
