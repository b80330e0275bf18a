"""An `AsyncOpenAI` client for policy endpoints that guarantees what GRPO needs, with no change to rollouts.

The rollout code calls ``client.chat.completions.create(model=policy, messages=...)`` as it would against
any OpenAI endpoint. Underneath, an httpx transport:

- adds ``logprobs: true`` and vLLM's ``return_token_ids: true`` to every chat request (unless the caller
  set them), so every answer carries the sampled token ids and their logprobs;
- adds a ``seed`` derived from the current rollout's identity when one is set with
  :func:`rollout_context` (``seed_i = H(run, step, scenario, index, i)`` for the i-th call of the
  rollout), so reruns sample the same tokens wherever the server runs;
- copies the response-level ``prompt_token_ids`` (vLLM puts it there) and the served model name onto
  every choice, so a bare ``Choice`` appended to a trajectory is self-contained;
- reports each call (model, token counts, latency) to the rollout's observer, if any (tracing hooks in here).

The client is an ``AsyncOpenAI`` whose chat calls cost the flow process less CPU (``agents/chat_create.py``: no
per-call parameter walk, answers built in compiled code), with the same requests and answers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai import AsyncOpenAI

from agents import json_codec


@dataclass
class CallRecord:
    """One chat call as seen by the transport (no token ids or logprobs: tracing keeps payloads small)."""

    model: str
    request_messages: list[dict[str, Any]]
    response_message: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    status: int


@dataclass
class RolloutContext:
    """Identity of the rollout in progress: derives per-call seeds and receives call records."""

    seed_material: str | None = None
    observer: Callable[[CallRecord], None] | None = None
    calls: int = 0
    records: list[CallRecord] = field(default_factory=list)
    replica: int | None = None  # the inference replica serving this rollout (agents/replica_router.py)

    def next_seed(self) -> int | None:
        if self.seed_material is None:
            return None
        digest = hashlib.sha256(f"{self.seed_material}/{self.calls}".encode()).digest()
        self.calls += 1
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


_CURRENT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("trajflow_rollout", default=None)


def rollout_seed_material(run: str, step: int, scenario_id: str, index: int) -> str:
    """The string all seeds of one rollout derive from: (run, step, scenario, index)."""
    return f"{run}/{step}/{scenario_id}/{index}"


@contextlib.contextmanager
def rollout_context(
    seed_material: str | None = None, observer: Callable[[CallRecord], None] | None = None
) -> Iterator[RolloutContext]:
    """Within this block (and tasks started from it), chat calls get derived seeds and are observed."""
    ctx = RolloutContext(seed_material=seed_material, observer=observer)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_rollout() -> RolloutContext | None:
    """The rollout in progress here (the innermost `rollout_context` of this task), or None outside one."""
    return _CURRENT.get()


def add_training_fields(body: dict[str, Any], ctx: RolloutContext | None) -> None:
    """Ask a chat request for what GRPO needs, where the caller left it unset: ``logprobs``, ``return_token_ids``,
    and the rollout's next derived ``seed`` (when `ctx` has seed material)."""
    body.setdefault("logprobs", True)
    body.setdefault("return_token_ids", True)
    if ctx is not None and "seed" not in body:
        seed = ctx.next_seed()
        if seed is not None:
            body["seed"] = seed


@functools.lru_cache(maxsize=1)
def shared_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS settings, built once per process: each new client would otherwise build its own (reading
    the CA bundle, ~30 ms on a loaded CPU), and a training step makes several clients (per task and per call)."""
    return httpx.create_ssl_context()


def _is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/chat/completions")


class _JsonAnswer(httpx.Response):
    """An answer whose ``json()`` (what the openai client parses it with) reads with orjson where that is exact
    (`agents.json_codec`): the stdlib's parser takes about 0.8 ms for an answer of 512 tokens with logprobs."""

    def json(self, **kwargs: Any) -> Any:
        if kwargs:
            return super().json(**kwargs)
        return json_codec.decode(self.content)[0]


class PolicyTransport(httpx.AsyncBaseTransport):
    """Rewrites chat requests and responses as described in the module docstring."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None):
        self._inner = inner or httpx.AsyncHTTPTransport(verify=shared_ssl_context())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_chat(request):
            return await self._inner.handle_async_request(request)
        ctx = current_rollout()
        body, encode = json_codec.decode(request.content or b"{}")
        add_training_fields(body, ctx)
        content = encode(body)
        headers = request.headers.copy()  # httpx sets the new body's length
        headers.pop("content-length", None)
        new_request = httpx.Request(request.method, request.url, headers=headers, content=content,
                                    extensions=request.extensions)
        started = time.perf_counter()
        response = await self._inner.handle_async_request(new_request)
        if body.get("stream") or "json" not in response.headers.get("content-type", ""):
            return response
        raw = await response.aread()
        await response.aclose()
        try:
            data, encode = json_codec.decode(raw)
        except ValueError:
            data = None
        if response.status_code == 200 and isinstance(data, dict):
            prompt_ids = data.get("prompt_token_ids")
            for choice in data.get("choices") or []:
                if prompt_ids is not None:
                    choice.setdefault("prompt_token_ids", prompt_ids)
                choice.setdefault("policy", data.get("model"))
            raw = encode(data)
        if ctx is not None:
            usage = (data or {}).get("usage") or {} if isinstance(data, dict) else {}
            choices = (data or {}).get("choices") or [] if isinstance(data, dict) else []
            record = CallRecord(
                model=str(body.get("model")),
                request_messages=body.get("messages") or [],
                response_message=(choices[0].get("message") if choices else None),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                latency_s=time.perf_counter() - started,
                status=response.status_code,
            )
            ctx.records.append(record)
            if ctx.observer is not None:
                ctx.observer(record)
        headers = response.headers.copy()
        for name in ("content-length", "content-encoding", "transfer-encoding"):
            headers.pop(name, None)
        return _JsonAnswer(response.status_code, headers=headers, content=raw, request=new_request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _AnswerCookies(httpx.Cookies):
    """httpx's cookie store, which reads an answer's cookies only when it sets one: httpx hands every answer to
    ``http.cookiejar`` (wrapping request and response for it), about 5% of the client's CPU time per chat call
    against policy servers that never set a cookie."""

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers or "set-cookie2" in response.headers:
            super().extract_cookies(response)


class _PolicyHttpClient(httpx.AsyncClient):
    """httpx's client with :class:`_AnswerCookies` (same cookies, kept the same way)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._cookies = _AnswerCookies(self._cookies)

    @property
    def cookies(self) -> httpx.Cookies:
        return self._cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._cookies = _AnswerCookies(cookies)


def policy_client(base_url: str | list[str], api_key: str | None = None, timeout: float = 600.0,
                  max_retries: int = 2, max_connections: int = 1024) -> AsyncOpenAI:
    """An AsyncOpenAI for a policy server (embedded or vLLM) with the transport above; given several base URLs
    (inference replicas), requests are spread over them by ``agents/replica_router.py``."""
    from agents.aiohttp_transport import AiohttpTransport
    from agents.chat_create import PolicyOpenAI
    from agents.replica_router import ReplicaRouter

    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    inner: httpx.AsyncBaseTransport = AiohttpTransport(max_connections, shared_ssl_context())
    if len(urls) > 1:
        inner = ReplicaRouter(urls, inner, rollout=current_rollout)
    http_client = _PolicyHttpClient(transport=PolicyTransport(inner), timeout=timeout, verify=shared_ssl_context())
    return PolicyOpenAI(base_url=urls[0], api_key=api_key or "EMPTY", http_client=http_client,
                        max_retries=max_retries, timeout=timeout)
