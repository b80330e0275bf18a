"""An AsyncOpenAI-shaped client over an in-process :class:`~backends.inference.engine.Engine`: no HTTP server, same answers.

``InProcessClient(engine).chat.completions.create(model=..., messages=..., ...)`` runs exactly what the embedded
server's ``POST /v1/chat/completions`` runs (`backends.serving.chat`: request validation, chat-template rendering, the
response JSON) and returns an ``openai`` ``ChatCompletion``. Like the trajflow policy client (`agents.client`) it
asks for logprobs and token ids on every call, copies ``prompt_token_ids`` and the policy name onto each choice,
and, inside :func:`agents.client.rollout_context`, seeds each call from the rollout's identity; so an agent's
``rollout(client, policy, scenario)`` records the same trajectories as through the server, with no sockets.

For scripts that hold the engine in the same process (GPU benchmarks, notebooks). Engine errors are raised as they
are (`RequestError` for a bad request, `UnknownModel` for an unknown policy name).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from backends.inference.engine import Engine
from backends.serving.chat import TokenText, parse_request, render_prompt, response_json, sampling_params


class _Completions:
    def __init__(self, engine: Engine):
        self._engine = engine
        self._names = TokenText(engine.tokenizer)

    async def create(self, **kwargs: Any):
        """One chat completion (``stream`` is refused); returns ``openai.types.chat.ChatCompletion``."""
        from openai.types.chat import ChatCompletion

        from agents.client import add_training_fields, current_rollout  # what the HTTP policy client adds

        if kwargs.get("stream"):
            raise ValueError("InProcessClient does not stream; call without stream=True")
        body = {k: v for k, v in kwargs.items() if v is not None}
        add_training_fields(body, current_rollout())
        req = parse_request(body)
        self._engine.adapters.resolve(req.model)  # unknown policy: UnknownModel before the template work
        prompt = render_prompt(self._engine.tokenizer, req)
        completions = await self._engine.generate(prompt, sampling_params(req), req.model, req.n)
        data = response_json(req, prompt, completions, self._names)
        for choice in data["choices"]:
            choice.setdefault("policy", data["model"])
        return ChatCompletion.model_validate(data)


class InProcessClient:
    """``client.chat.completions.create(...)`` against `engine` in this process (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.chat = SimpleNamespace(completions=_Completions(engine))
