"""A policy written as code, reached through the ``openai`` client's interface, so an agent's own rollout runs it.

``ScriptedPolicy(act)`` has ``chat.completions.create(**request)``: it calls ``act(messages, tools)``, which returns
the next assistant message (``{"content": ...}`` and/or ``{"tool_calls": [...]}``), and answers with an openai
``ChatCompletion`` holding that message as its one choice. The agent's ``rollout`` is unchanged: it builds the
system prompt and user turns, runs its real tools on the calls, appends their results and scores the episode exactly
as it does for a model. That is what makes a scripted expert's conversations demonstrations in the agent's real shape.

Choices:

1. No token ids or logprobs: a scripted turn is text, not sampled tokens, so its ``SampledTurn`` is not trainable by
   GRPO. Demonstrations are for supervised training, which renders the messages with the model's chat template.
2. Tool-call arguments are written as the embedded server writes a parsed call's (``json.dumps(args,
   ensure_ascii=False)``), and ids are ``call_<turn>_<tool>``, deterministic, so a demonstration file is the same
   bytes every time it is generated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletion

Act = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], dict[str, Any]]


class ExpertError(RuntimeError):
    """A scripted expert cannot play this conversation (a scenario it does not know, a state it did not expect)."""


def tool_call_message(turn: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with one tool call, content null (the OpenAI shape of a call without prose)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{turn}_{name}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}]}


def assistant_turns(messages: list[dict[str, Any]]) -> int:
    """How many assistant messages a conversation holds: the index of the turn about to be taken."""
    return sum(1 for m in messages if m.get("role") == "assistant")


class ScriptedPolicy:
    """``act`` behind ``client.chat.completions.create``; counts the requests it answered."""

    def __init__(self, act: Act, name: str = "expert"):
        self.act, self.name, self.requests = act, name, 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, *, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      **_sampling: Any) -> ChatCompletion:
        # model, max_tokens, temperature...: a scripted policy is deterministic and never runs out of tokens
        self.requests += 1
        message = {"role": "assistant", "content": None, **self.act(messages, tools)}
        return ChatCompletion.model_validate({
            "id": f"scripted-{self.requests}", "object": "chat.completion", "created": 0, "model": self.name,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]})
