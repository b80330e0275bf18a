"""A run's `vllm serve`: RunConfig's inference section turned into the launcher's `VLLMConfig`.

- The base model: trajflow's names (``smollm2-135m``, ``tiny-random``) mean nothing to vLLM, so it gets the local
  Hugging Face folder `resolve_model` gives the embedded engine and the trainer, and serves it under the name the
  embedded engine uses (`ModelSpec.name`), so both backends answer to the same base name.
- The command: ``inference.vllm_command`` (an argv; vLLM usually lives in an environment of its own).
- The environment: ``inference.vllm_env``; a mapping is passed as is, a list names variables copied from the flow's
  environment, each of which must be set (a missing credential fails here, in one line, not in vLLM's log).
- Port 0 means a free port, as for the embedded server.
- The device: ``cuda:K`` becomes CUDA_VISIBLE_DEVICES (``tasks/support/placement.py``), unless ``vllm_env`` sets it.
- The log: ``<run>.vllm-<replica>.log`` beside the run's log file (``tasks/support/run_logs.py``).
- The chat template: vLLM renders chats with the model folder's template, which for a ChatML model like SmolLM2
  ignores ``tools``: the model would never see the tools it is asked to call (measured on the H200: the research
  agent's SFT'd policy made no tool call through vLLM). Where the embedded server substitutes
  ``TOOL_CHAT_TEMPLATE`` (`backends/modeling/chat_render.py::tool_use_template`), the same template is written
  beside vLLM's log (``<run>.vllm-<replica>.chat-template.jinja``) and passed as ``--chat-template``, so both
  backends give the model the same prompt.
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.modeling.chat_render import tool_use_template
from backends.modeling.loading import resolve_model
from backends.serving.vllm import VLLMConfig
from tasks.run_config import RunConfig
from tasks.support.placement import cuda_visible
from tasks.support.run_logs import server_log_file


def vllm_env(spec: list[str] | dict[str, str | None], environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """`inference.vllm_env` as a mapping: a list's names take their values from `environ` (os.environ)."""
    if isinstance(spec, dict):
        return dict(spec)
    environ = os.environ if environ is None else environ
    missing = [name for name in spec if name not in environ]
    if missing:
        raise ValueError(f"inference.vllm_env names {', '.join(missing)}, not set in the flow's environment")
    return {name: environ[name] for name in spec}


def chat_template_file(model_folder: Path, log_file: Path) -> str | None:
    """The ``--chat-template`` file for vLLM serving `model_folder` (written beside `log_file`), or None when the
    model's own template renders tools (module docstring)."""
    from transformers import AutoTokenizer

    template = tool_use_template(AutoTokenizer.from_pretrained(str(model_folder)))
    if template is None:
        return None
    path = log_file.with_name(log_file.stem + ".chat-template.jinja")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(template)
    return str(path)


def vllm_config(config: RunConfig, api_key: str | None, device: str | None = None,
                port: int | None = None, replica: int = 0) -> VLLMConfig:
    """The launcher's config for replica `replica` of this run's vLLM (module docstring) on `device` ('cuda:K'; None:
    vLLM's default) and `port` (None: inference.port)."""
    inf = config.inference
    spec = resolve_model(config.base_model)
    env = vllm_env(inf.vllm_env)
    if device is not None and device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible([device], os.environ.get("CUDA_VISIBLE_DEVICES"))
    log_file = server_log_file(config.project, config.run, "vllm", replica)
    return VLLMConfig(
        model=str(spec.path), served_model_name=spec.name, host=inf.host, port=inf.port if port is None else port,
        api_key=api_key,
        max_lora_rank=inf.max_lora_rank, max_loras=inf.max_loras,
        gpu_memory_utilization=inf.gpu_memory_utilization, max_model_len=inf.max_model_len,
        tool_call_parser=inf.tool_call_parser, executable=inf.vllm_command, env=env,
        chat_template=chat_template_file(spec.path, log_file), log_path=str(log_file),
    )
