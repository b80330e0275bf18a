"""Demonstrations for supervised training (SFT): OpenAI chat-format conversations, read from JSONL and checked.

File format, one conversation per line::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "search", "arguments": "{\\"query\\": \\"...\\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "..."},
                  {"role": "assistant", "content": "..."}],
     "tools": [{"type": "function", "function": {"name": "search", "parameters": {...}}}],
     "metadata": {"scenario": "..."}}

``tools`` may be absent (an agent without tools); ``metadata`` is kept for provenance and never trained. Blank lines
are ignored. Scripts may pass the same dicts, or ART-style ``Trajectory`` objects (their conversation, and each
additional history, is one demonstration; a sampled turn counts as its assistant message).

Checked here, each an error naming the line (1-based) or, with ``on_bad_line="skip"``, a counted skip: not JSON;
not an object with a non-empty ``messages`` list; a message the chat template cannot take (unknown role, content
neither text nor null; backends/modeling/chat_render.py); malformed ``tools``; an assistant tool call whose name is
not among ``tools``; tool-call arguments that are not JSON; a tool message whose ``tool_call_id`` answers no earlier
tool call; no assistant turn. An empty file is always an error. What needs the tokenizer (a conversation longer than
the context, a template that rewrites earlier turns) is checked when the rows are built (``sft_rows.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.modeling.chat_render import ChatRenderError, normalise_messages, tool_names

OnBadLine = Literal["error", "skip"]


class DemonstrationError(ValueError):
    """A demonstration that cannot be trained on, naming its line and what is wrong."""


@dataclass
class Demonstration:
    """One conversation to imitate; `where` names it in messages (``demos.jsonl line 3``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    where: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class BadLines:
    """What to do with a bad demonstration: raise (``error``) or count it and go on (``skip``)."""

    mode: OnBadLine = "error"
    skipped: list[str] = field(default_factory=list)

    def handle(self, error: DemonstrationError) -> None:
        if self.mode != "skip":
            raise error
        self.skipped.append(str(error))


def _check_tool_calls(messages: list[dict], tools: list[dict] | None, where: str) -> None:
    names = tool_names(tools)
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call["function"]
                at = f"messages[{i}].tool_calls[{j}]"
                if fn["name"] not in names:
                    offered = f"not among the tools ({', '.join(names)})" if names else "but the line has no tools"
                    raise DemonstrationError(f"{where}: {at} calls {fn['name']!r}, {offered}")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        json.loads(args)
                    except ValueError as e:
                        raise DemonstrationError(f"{where}: {at}.function.arguments is not valid JSON ({e})") from None
                elif not isinstance(args, dict):
                    raise DemonstrationError(f"{where}: {at}.function.arguments must be a JSON string, "
                                             f"got {type(args).__name__}")
                if isinstance(call.get("id"), str):
                    called.add(call["id"])
        elif m.get("role") == "tool":
            answered = m.get("tool_call_id")
            if answered not in called:
                raise DemonstrationError(f"{where}: messages[{i}] (tool) answers tool_call_id {answered!r}, which no "
                                         "earlier assistant tool call has")


def demonstration(obj: Any, where: str) -> Demonstration:
    """Check one parsed line (or a script's dict); raises DemonstrationError naming `where`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        got = type(obj).__name__ if not isinstance(obj, dict) else "an object without a non-empty 'messages' list"
        raise DemonstrationError(f"{where}: expected an object with a non-empty 'messages' list, got {got}")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DemonstrationError(f"{where}: 'tools' must be a list of OpenAI tool schemas")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DemonstrationError(f"{where}: 'metadata' must be an object")
    try:
        normalise_messages(obj["messages"], args_as_strings=True)  # the server's own message checks
        _check_tool_calls(obj["messages"], tools, where)
    except ChatRenderError as e:
        raise DemonstrationError(f"{where}: {e}") from None
    if not any(m.get("role") == "assistant" for m in obj["messages"]):
        raise DemonstrationError(f"{where}: no assistant turn to train on")
    return Demonstration(list(obj["messages"]), list(tools) if tools else None, where, dict(metadata))


def parse_jsonl(text: str, source: str, bad: BadLines) -> list[Demonstration]:
    """The demonstrations of a JSONL file's text; `source` names the file in messages."""
    demos: list[Demonstration] = []
    lines = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        where = f"{source} line {number}"
        try:
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DemonstrationError(f"{where}: not valid JSON ({e})") from None
            demos.append(demonstration(obj, where))
        except DemonstrationError as e:
            bad.handle(e)
    if not lines:
        raise DemonstrationError(f"{source}: empty (no conversation); expected one JSON object per line")
    return demos


def _history_dicts(item: Any, index: int) -> list[tuple[dict[str, Any], str]]:
    """A Trajectory/History as (conversation dict, where) pairs: its conversation, then each additional history."""
    out = [({"messages": item.messages(), "tools": item.tools}, f"conversation {index}")]
    for h, hist in enumerate(getattr(item, "additional_histories", None) or []):
        out.append(({"messages": hist.messages(), "tools": hist.tools}, f"conversation {index}, additional history {h}"))
    return out


def demonstrations_of(items: Iterable[Any], bad: BadLines) -> list[Demonstration]:
    """Demonstrations from a script's items: conversation dicts or Trajectory/History objects (ART's form)."""
    demos: list[Demonstration] = []
    count = 0
    for index, item in enumerate(items):
        count += 1
        pairs = _history_dicts(item, index) if hasattr(item, "messages_and_choices") else [(item, f"conversation {index}")]
        for obj, where in pairs:
            try:
                demos.append(demonstration(obj, where))
            except DemonstrationError as e:
                bad.handle(e)
    if not count:
        raise DemonstrationError("no conversations given")
    return demos
