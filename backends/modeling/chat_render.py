"""Chat messages -> token ids with the model's chat template: the one rendering the server's prompts and the
supervised (SFT) rows share, so a demonstration trains on exactly the tokens a rollout's prompt would show.

- Roles: system, developer (rendered as system), user, assistant, tool. Content is a string, a list of text parts
  (joined with newlines) or null (assistant turns only).
- Tools go to the chat template. A template that ignores tools but is ChatML is replaced by ``TOOL_CHAT_TEMPLATE``
  (``<tool_call>{json}</tool_call>`` the Qwen/Hermes way); a non-ChatML one is refused.
- Assistant ``tool_calls`` arguments reach the template as the JSON strings the model wrote when the template prints
  strings verbatim (ours does: ``"is string"`` in its source), so a re-rendered conversation extends an earlier
  turn token for token; otherwise they are parsed into objects first.
- The end of a turn is any of the model's end-of-sequence ids (its generation config's and its tokenizer's): the
  engine stops sampling there, and SFT trains the assistant's turn through it.

Every problem is a :class:`ChatRenderError` naming the message (``messages[3].content ...``); the server answers it
with a 400, SFT with the demonstration's line.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRenderError(ValueError):
    """Messages or tools the chat template cannot render, naming which."""


def _text_of(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatRenderError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                      "supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ChatRenderError(f"{where}.content must be a string, a list of text parts, or null")


def normalise_messages(messages: list[dict], args_as_strings: bool) -> list[dict]:
    """Check roles/contents and produce the plain dicts chat templates expect."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatRenderError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ChatRenderError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        content = _text_of(m.get("content"), where)
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ChatRenderError(f"{where}.tool_calls must be a list")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatRenderError(f"{where}.tool_calls[{j}] needs function.name")
                args = fn.get("arguments", "{}")
                if not args_as_strings and isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ChatRenderError(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
                msg["tool_calls"].append({"id": call.get("id"), "type": "function",
                                          "function": {"name": fn["name"], "arguments": args}})
        elif content is None and role != "assistant":
            raise ChatRenderError(f"{where}.content is required for role {role!r}")
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    return out


def tool_names(tools: list[dict] | None) -> list[str]:
    """The function names of OpenAI-format `tools`; a malformed tool is an error naming it."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(fn, dict) or tool.get("type", "function") != "function"
                or not isinstance(fn.get("name"), str)):
            raise ChatRenderError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ChatRenderError(f"tools[{i}].function.parameters must be a JSON Schema object "
                                  f"({{'type': 'object', 'properties': ...}}), got {params!r:.80}")
        names.append(fn["name"])
    return names


def _own_template(tokenizer, tools) -> str | None:
    """The model's own template: its tool-use variant with tools, where it has named variants."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return template


def chat_template_for(tokenizer, tools: list[dict] | bool | None) -> str:
    """The template that renders these messages (`tools`: the request's tools, or just whether there are any): the
    model's (its tool-use variant with tools), or ``TOOL_CHAT_TEMPLATE`` for a ChatML model whose template ignores
    tools. A server that renders chats itself (vLLM) must be given the same template: `tool_use_template`."""
    from backends.modeling.loading import TOOL_CHAT_TEMPLATE

    template = _own_template(tokenizer, tools)
    if not template:
        raise ChatRenderError("this model has no chat template")
    if tools and "tools" not in template:
        if "<|im_start|>" not in template:
            raise ChatRenderError("this model's chat template does not render tools")
        template = TOOL_CHAT_TEMPLATE
    return template


def tool_use_template(tokenizer) -> str | None:
    """The template a chat with tools needs when it is not the model's own (``TOOL_CHAT_TEMPLATE`` for a ChatML model
    whose template ignores tools); None when the model's own renders tools, or when nothing here can (a
    `ChatRenderError` for such a chat, raised where one is rendered)."""
    try:
        template = chat_template_for(tokenizer, tools=True)
    except ChatRenderError:
        return None
    return None if template == _own_template(tokenizer, True) else template


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, *,
                add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` (and `tools`) under the chat template; with `add_generation_prompt`, the prompt the
    engine continues to sample the next assistant turn."""
    from jinja2 import TemplateError

    tools = tools or None
    tool_names(tools)
    template = chat_template_for(tokenizer, tools)
    normalised = normalise_messages(messages, args_as_strings="is string" in template)
    try:
        ids = tokenizer.apply_chat_template(normalised, tools=tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=True)
    except TemplateError as e:
        raise ChatRenderError(f"the chat template rejected the messages: {e}") from None
    ids = ids["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """The ids that end a turn: the generation config's end-of-sequence ids and the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    for value in eos if isinstance(eos, (list, tuple)) else [eos]:
        if value is not None:
            ids.add(int(value))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
