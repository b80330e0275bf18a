"""Parsing Hermes/Qwen tool calls out of model text; anything malformed stays plain content."""

import json

import pytest

from backends.serving.tool_calls import parse_tool_calls


def test_one_call_with_leading_text():
    content, calls = parse_tool_calls('Let me check.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content == "Let me check."
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[0]["id"].startswith("chatcmpl-tool-")


def test_several_calls_string_arguments_and_parameters_synonym():
    text = ('<tool_call>\n{"name": "a", "arguments": "{\\"q\\": \\"é\\"}"}\n</tool_call>\n'
            '<tool_call>{"name": "b", "parameters": {}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["function"]["arguments"] == '{"q": "é"}' and calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',            # unterminated (cut by max_tokens)
    "<tool_call>{not json}</tool_call>",
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',                    # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',      # arguments not an object
    '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>',  # one bad block spoils all
])
def test_malformed_output_is_plain_content(text):
    assert parse_tool_calls(text) == (text, [])
