"""SFT test data: demonstrations in the OpenAI chat format (a multi-turn tool conversation, tool-less ones), and a
JSONL writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEARCH = {"type": "function", "function": {"name": "search", "description": "search the corpus",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}
READ = {"type": "function", "function": {"name": "read", "parameters": {"type": "object",
                                                                        "properties": {"id": {"type": "integer"}}}}}
TOOLS = [SEARCH, READ]


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# system, user, a tool call, its result, two calls at once (with text before them), both results, the answer
TOOL_CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Answer with the tools."},
        {"role": "user", "content": "Where is the Eiffel tower?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "search", '{"query": "eiffel tower"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "doc 3: The Eiffel tower"},
        {"role": "assistant", "content": "Reading two.",
         "tool_calls": [call("c2", "read", '{"id": 3}'), call("c3", "read", '{"id": 4}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "It stands in Paris."},
        {"role": "tool", "tool_call_id": "c3", "content": "Unrelated."},
        {"role": "assistant", "content": "In Paris."},
    ],
    "tools": TOOLS,
    "metadata": {"scenario": "eiffel", "split": "train"},
}
# the text each assistant turn is trained on, as the chat template (TOOL_CHAT_TEMPLATE) writes it
TOOL_CONVERSATION_TURNS = [
    '<tool_call>{"name": "search", "arguments": {"query": "eiffel tower"}}</tool_call>',
    ('Reading two.\n<tool_call>{"name": "read", "arguments": {"id": 3}}</tool_call>\n'
     '<tool_call>{"name": "read", "arguments": {"id": 4}}</tool_call>'),
    "In Paris.",
]
ARITHMETIC = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                            {"role": "assistant", "content": f"<answer>{a + b}</answer>"}]}
              for a, b in ((2, 3), (4, 1), (6, 2))]


def write_jsonl(path: Path, conversations: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


@pytest.fixture
def demo_file(tmp_path) -> Path:
    """A demonstrations file: the tool conversation and three arithmetic ones."""
    return write_jsonl(tmp_path / "demos.jsonl", [TOOL_CONVERSATION, *ARITHMETIC])
