"""OpenAI chat completions <-> engine requests: validation, chat-template rendering, and the response JSON.

Dialect (what vLLM's OpenAI server does, so callers cannot tell the two apart):

- Accepted: ``model, messages, tools, tool_choice, n, temperature, top_p, max_tokens | max_completion_tokens,
  seed, stop, logprobs, top_logprobs, stream, stream_options`` and vLLM's extras ``stop_token_ids, ignore_eos,
  return_token_ids, return_tokens_as_token_ids, logprobs_mode``. Unknown extra keys are ignored; features we do not
  implement but whose values would change the answer (penalties, logit_bias, top_k, min_p, json response formats,
  ``logprobs_mode`` other than raw) are refused with a 400 rather than silently dropped.
- Refused as OpenAI and vLLM refuse them: values of the wrong JSON type (no coercion of ``"2"`` to 2),
  ``top_logprobs`` without ``logprobs: true``, ``stop_token_ids`` outside the vocabulary, a tool whose
  ``parameters`` is not a JSON Schema object.
- The response carries ``prompt_token_ids`` at the top level (vLLM) and per choice, and per choice ``token_ids``
  (every sampled id, EOS included) and ``stop_reason``. ``logprobs.content[j]`` exists for every sampled token when
  ``logprobs`` is true; its logprob is the raw one (`backends.inference.sampling`).
- Tools are given to the chat template. If the model's template ignores tools but is ChatML, our
  ``TOOL_CHAT_TEMPLATE`` renders them instead. With tools and ``tool_choice`` other than ``"none"``, the output is
  parsed by `backends.serving.tool_calls`; ``"required"`` and a named tool are *not* enforced by constrained
  decoding (the model is only prompted), a documented difference from vLLM's guided decoding.
- Assistant ``tool_calls`` arguments go to the template as the JSON strings the model wrote when the template
  prints strings verbatim (ours does), so the re-rendered prompt extends the earlier turn token for token.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.inference.engine import MAX_TOP_LOGPROBS, Completion, RequestError, SamplingParams
from backends.modeling.chat_render import ChatRenderError, render_chat, tool_names
from backends.serving.response_bytes import check_finite
from backends.serving.token_text import TokenText
from backends.serving.tool_calls import parse_tool_calls


class SamplingFields(BaseModel):
    """Request fields chat and text completions share (extra keys are kept and ignored). Types are strict, as
    OpenAI's are: ``"n": "2"`` or ``"max_tokens": 5.0`` is refused rather than coerced (an int is a valid float)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool | None = False
    logprobs_mode: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to a value the embedded engine would have to ignore (subclasses add theirs)."""
        return [
            name for name, ok in (
                ("frequency_penalty", not self.frequency_penalty), ("presence_penalty", not self.presence_penalty),
                ("repetition_penalty", self.repetition_penalty in (None, 1.0)), ("logit_bias", not self.logit_bias),
                ("top_k", self.top_k in (None, 0, -1)), ("min_p", not self.min_p),
                ("response_format", (self.response_format or {}).get("type", "text") == "text"),
                ("logprobs_mode", self.logprobs_mode in (None, "raw_logprobs")),
            ) if not ok
        ]

    def sampling(self, max_tokens: int | None, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
        )


class ChatRequest(SamplingFields):
    """The body of POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true (as in OpenAI's API)")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v not in ("auto", "none", "required"):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}")
        if isinstance(v, dict) and not isinstance((v.get("function") or {}).get("name"), str):
            raise ValueError("a named tool_choice needs {'type': 'function', 'function': {'name': ...}}")
        return v


def validate_body(model: type[SamplingFields], body: Any) -> SamplingFields:
    """Validate a JSON body as `model`; raises RequestError naming every problem, or every unsupported feature."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
        raise RequestError(problems) from None
    unsupported = req.unsupported()
    if unsupported:
        raise RequestError(f"not supported by the embedded engine: {', '.join(unsupported)} (remove them, or use "
                           "their neutral values)")
    return req


def parse_request(body: Any) -> ChatRequest:
    """Validate a chat completions body; raises RequestError with every problem named."""
    return validate_body(ChatRequest, body)


def sampling_params(req: ChatRequest) -> SamplingParams:
    return req.sampling(req.max_completion_tokens or req.max_tokens, (req.top_logprobs or 0) if req.logprobs else 0)


def _check_tools(req: ChatRequest) -> list[dict] | None:
    if not req.tools:
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            raise RequestError("tool_choice requires tools")
        return None
    try:
        names = tool_names(req.tools)
    except ChatRenderError as e:
        raise RequestError(str(e)) from None
    if isinstance(req.tool_choice, dict) and req.tool_choice["function"]["name"] not in names:
        raise RequestError(f"tool_choice names {req.tool_choice['function']['name']!r}, not among the tools "
                           f"({', '.join(names)})")
    return req.tools


def render_prompt(tokenizer, req: ChatRequest) -> list[int]:
    """Prompt token ids: the chat template over the messages (and tools), with the generation prompt
    (backends/modeling/chat_render.py, shared with supervised training)."""
    tools = _check_tools(req)
    try:
        return render_chat(tokenizer, req.messages, tools, add_generation_prompt=True)
    except ChatRenderError as e:
        raise RequestError(str(e)) from None


def logprobs_json(token_ids: list[int], logprobs: list[float], top_logprobs: list | None, names: TokenText,
                  as_ids: bool) -> dict:
    """``logprobs`` of a choice, or of a streamed chunk's tokens."""
    check_finite(logprobs, "logprob")
    content = []
    for j, (tok, lp) in enumerate(zip(token_ids, logprobs)):
        tops = []
        if top_logprobs is not None:
            check_finite([v for _, v in top_logprobs[j]], "top logprob")
            for t, v in top_logprobs[j]:
                label, raw = names.entry(t, as_ids)
                tops.append({"token": label, "bytes": raw, "logprob": v})
        label, raw = names.entry(tok, as_ids)
        content.append({"token": label, "bytes": raw, "logprob": lp, "top_logprobs": tops})
    return {"content": content}


def tools_parsed(req: ChatRequest) -> bool:
    """Whether the answer's text is parsed for tool calls."""
    return bool(req.tools) and req.tool_choice != "none"


def choice_json(index: int, c: Completion, req: ChatRequest, prompt: list[int], names: TokenText) -> dict:
    """One `choices[i]` of the response."""
    content, calls = c.text, []
    if tools_parsed(req):
        content, calls = parse_tool_calls(c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
    return {
        "index": index,
        "message": message,
        "logprobs": (logprobs_json(c.token_ids, c.logprobs, c.top_logprobs, names, bool(req.return_tokens_as_token_ids))
                     if req.logprobs else None),
        "finish_reason": "tool_calls" if calls else c.finish_reason,
        "stop_reason": c.stop_reason,
        "token_ids": c.token_ids,
        "prompt_token_ids": prompt,
    }


def response_json(req: ChatRequest, prompt: list[int], completions: list[Completion], names: TokenText) -> dict:
    """The chat.completion object."""
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice_json(i, c, req, prompt, names) for i, c in enumerate(completions)],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                  "total_tokens": len(prompt) + generated},
        "prompt_token_ids": prompt,
    }
