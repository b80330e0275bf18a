"""An AsyncOpenAI-shaped client over an in-process :class:`~backends.inference.engine.Engine`: no HTTP server, same answers.

``InProcessClient(engine).chat.completions.create(model=..., messages=..., ...)`` runs exactly what the embedded
server's ``POST /v1/chat/completions`` runs (`backends.serving.chat`: request validation, chat-template rendering, the
response JSON) and returns an ``openai`` ``ChatCompletion``. Like the trajflow policy client (`agents.client`) it
asks for logprobs and token ids on every call, copies ``prompt_token_ids`` and the policy name onto each choice,
and, inside :func:`agents.client.rollout_context`, seeds each call from the rollout's identity; so an agent's
``rollout(client, policy, scenario)`` records the same trajectories as through the server, with no sockets.

For scripts that hold the engine in the same process (GPU benchmarks, notebooks). Errors are the ``openai`` exceptions
the HTTP client raises for the server's answer: ``BadRequestError`` (400) for a bad request, a prompt past the context
included (so `agents.examples.turn_sampling` ends such an episode as it does over HTTP, instead of failing the
rollout), ``NotFoundError`` (404) for an unknown policy name; the engine's own exception is the ``__cause__``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from backends.inference.adapters import UnknownModel
from backends.inference.engine import Engine, RequestError
from backends.serving.chat import parse_request, render_prompt, response_json, sampling_params
from backends.serving.token_text import TokenText


def _status_error(status: int, message: str):
    """The ``openai`` exception its client raises for an error answer `status` of the embedded server (the client's
    message format, ``Error code: <status> - <message>``; the response is the one the server would send)."""
    import openai

    from backends.serving.app import error_response

    try:  # the HTTP library of the installed openai client (httpx2 in openai >= 3)
        import httpx2 as http
    except ImportError:
        import httpx as http
    response = http.Response(status, request=http.Request("POST", "http://in-process/v1/chat/completions"),
                             content=error_response(status, message).body)
    kind = {400: openai.BadRequestError, 404: openai.NotFoundError}[status]
    return kind(f"Error code: {status} - {message}", response=response, body=response.json()["error"])


class _Completions:
    def __init__(self, engine: Engine):
        self._engine = engine
        self._names = TokenText(engine.tokenizer, engine.vocab)

    async def create(self, **kwargs: Any):
        """One chat completion (``stream`` is refused); returns ``openai.types.chat.ChatCompletion``."""
        from openai.types.chat import ChatCompletion

        from agents.client import add_training_fields, current_rollout  # what the HTTP policy client adds

        if kwargs.get("stream"):
            raise ValueError("InProcessClient does not stream; call without stream=True")
        body = {k: v for k, v in kwargs.items() if v is not None}
        add_training_fields(body, current_rollout())
        try:
            req = parse_request(body)
            self._engine.adapters.resolve(req.model)  # unknown policy: UnknownModel before the template work
            prompt = render_prompt(self._engine.tokenizer, req)
            completions = await self._engine.generate(prompt, sampling_params(req), req.model, req.n)
        except RequestError as exc:
            raise _status_error(400, str(exc)) from exc
        except UnknownModel as exc:
            raise _status_error(404, str(exc)) from exc
        data = response_json(req, prompt, completions, self._names)
        for choice in data["choices"]:
            choice.setdefault("policy", data["model"])
        return ChatCompletion.model_validate(data)


class InProcessClient:
    """``client.chat.completions.create(...)`` against `engine` in this process (see the module docstring)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.chat = SimpleNamespace(completions=_Completions(engine))
