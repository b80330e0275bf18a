"""``chat.completions.create`` of the policy client: the openai client's call, less its two per-call Python walks.

**The request.** The openai client turns the keyword arguments of ``create`` into the request body with
``async_maybe_transform``: a recursive walk of every value against the ``TypedDict`` annotations of the parameters
(renaming aliased keys, formatting dates and files, dumping pydantic models). For a chat request that walk tries
every member of the message union on every message, and it was the largest part of the flow process's CPU time per
call (``benchmarks/rollout_client_cpu.py``: about 60% of the client side of an arithmetic rollout). The chat
parameters declare no alias and no format, so on plain JSON values (dicts with string keys, lists, strings,
numbers, booleans, None) the walk returns its input less the omitted values: :class:`PolicyCompletions` builds that
body directly and posts it with the same options and response type as openai's ``create``.

Simplifications, each falling back to openai's own ``create`` (same answer, full cost):

1. Only plain JSON values take the short path: a pydantic message (``choice.message`` appended as is), a tuple or
   a generator of messages, a ``response_format`` class, a date go through the transform.
2. Only the parameters ``create`` declares: an unknown keyword goes to openai, which raises its ``TypeError``.
3. Streaming requests go to openai (rollouts do not stream; the stream's chunk parsing dominates there anyway).

**The answer.** openai builds the ``ChatCompletion`` with its own ``construct`` (no validation: a Python walk over
the model's type hints for every field of every nested model, about 165 us for a 16-token answer with logprobs);
pydantic's strict validation builds the same objects in compiled code (about 50 us). :class:`PolicyOpenAI` tries
that first: strict mode coerces nothing (a string is never read as a number), so an answer it accepts dumps
exactly as openai's (``model_dump``, ``to_dict``, ``to_json``, extra fields such as ``token_ids`` included); the
one difference is that ``model_fields_set`` also names the extra fields, which no dump shows. An answer it refuses
(a server's field of an unexpected type) goes to openai's ``construct``, which keeps it as sent.

Everything else the client does is unchanged: retries, error types, auth headers, ``with_raw_response``,
``extra_headers`` / ``extra_body`` / ``timeout``, and every other resource.
"""

from __future__ import annotations

import inspect
from typing import Any

import pydantic
from openai import AsyncOpenAI, AsyncStream
from openai._base_client import make_request_options
from openai._utils import is_given
from openai._compat import cached_property
from openai.resources.chat import AsyncChat
from openai.resources.chat.completions import AsyncCompletions
from openai.types.chat import ChatCompletion, ChatCompletionChunk

_REQUEST_OPTIONS = ("extra_headers", "extra_query", "extra_body", "timeout")
# The body's keys: every keyword of the installed openai's create except the request options.
BODY_KEYS: frozenset[str] = frozenset(
    name for name, p in inspect.signature(AsyncCompletions.create).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _REQUEST_OPTIONS)
# The options openai's create adds of its own (bearer auth, in clients that have per-request security options).
_OWN_OPTIONS: dict[str, Any] = (
    {"security": {"bearer_auth": True}} if "security" in inspect.signature(make_request_options).parameters else {})


_SCALARS = frozenset((str, int, float, bool, type(None)))


def is_plain_json(value: Any) -> bool:
    """True when `value` is made only of dicts with string keys, lists, str, int, float, bool and None (exact types:
    a subclass may serialize otherwise). A loop, not recursion: a deep conversation cannot reach the stack limit."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind is list:
            stack.extend(item)
        elif kind is dict:
            if not all(type(k) is str for k in item):
                return False
            stack.extend(item.values())
        else:
            return False
    return True


def plain_body(params: dict[str, Any]) -> dict[str, Any] | None:
    """The request body openai's transform would make of `params` (create's keywords), or None where it could
    differ (see the module docstring's list)."""
    if params.get("stream") or "messages" not in params or "model" not in params:
        return None
    body: dict[str, Any] = {}
    for key, value in params.items():
        if key in _REQUEST_OPTIONS:
            continue
        if key not in BODY_KEYS:
            return None
        if value is None or type(value) in (str, int, float, bool):
            body[key] = value
        elif type(value) in (list, dict) and is_plain_json(value):
            body[key] = value
        elif is_given(value):
            return None
    return body


class PolicyCompletions(AsyncCompletions):
    """openai's chat completions resource; ``create`` skips the parameter walk on plain JSON parameters."""

    async def create(self, **params: Any) -> Any:  # type: ignore[override]
        body = plain_body(params)
        if body is None:
            return await super().create(**params)
        options = {k: params[k] for k in _REQUEST_OPTIONS if k in params}
        return await self._post(
            "/chat/completions", body=body, options=make_request_options(**options, **_OWN_OPTIONS),
            cast_to=ChatCompletion, stream=False, stream_cls=AsyncStream[ChatCompletionChunk])


class PolicyChat(AsyncChat):
    @cached_property
    def completions(self) -> PolicyCompletions:
        return PolicyCompletions(self._client)


class PolicyOpenAI(AsyncOpenAI):
    """An ``AsyncOpenAI`` whose ``chat.completions.create`` is :class:`PolicyCompletions`'s and whose chat answers
    are built by strict validation where it accepts them (module docstring); all else is openai's."""

    @cached_property
    def chat(self) -> PolicyChat:
        return PolicyChat(self)

    def _process_response_data(self, *, data: object, cast_to: Any, response: Any) -> Any:
        if cast_to is ChatCompletion and isinstance(data, dict):
            try:
                return ChatCompletion.model_validate(data, strict=True)
            except pydantic.ValidationError:
                pass  # openai's construct keeps what strict validation refuses
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)
