"""Catalogue: every bad demonstration line we know of, and the error naming its line (1-based) that each gives; with
``on_bad_line: skip`` each is counted and the good lines train. Add a row for every bad line found.

Lines that need the tokenizer (longer than the context, a template that rewrites earlier turns) are in
test_sft_rows.py; the same mistakes through `trajflow sft` / `trajflow train` are in
tests/unit/flows/test_bad_inputs_cli.py.
"""

from __future__ import annotations

import json

import pytest

from backends.training.sft_data import BadLines, DemonstrationError, demonstrations_of, parse_jsonl
from tests.fixtures_sft import ARITHMETIC, TOOL_CONVERSATION, TOOLS, call

GOOD = json.dumps(ARITHMETIC[0])
USER = {"role": "user", "content": "q"}


def _line(messages, tools=TOOLS) -> str:
    return json.dumps({"messages": messages, **({"tools": tools} if tools is not None else {})})


CASES = [
    # id, the bad line (line 2 of the file, after a good one), text the error holds after "demos.jsonl line 2: "
    ("not JSON", '{"messages": [', "not valid JSON (Expecting value"),
    ("not an object", "[1, 2]", "expected an object with a non-empty 'messages' list, got list"),
    ("no messages", '{"conversation": []}', "expected an object with a non-empty 'messages' list"),
    ("empty messages", '{"messages": []}', "expected an object with a non-empty 'messages' list"),
    ("unknown role", _line([USER, {"role": "robot", "content": "x"}]),
     "messages[1].role must be one of system, developer, user, assistant, tool, got 'robot'"),
    ("content not text", _line([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]),
     "messages[0].content must be a string, a list of text parts, or null"),
    ("tool call without a name", _line([USER, {"role": "assistant", "content": None,
                                               "tool_calls": [{"id": "a", "function": {}}]}]),
     "messages[1].tool_calls[0] needs function.name"),
    ("tool not among tools", _line([USER, {"role": "assistant", "content": None,
                                           "tool_calls": [call("a", "serch", "{}")]}]),
     "messages[1].tool_calls[0] calls 'serch', not among the tools (search, read)"),
    ("tool call without tools", _line([USER, {"role": "assistant", "content": None,
                                              "tool_calls": [call("a", "search", "{}")]}], tools=None),
     "messages[1].tool_calls[0] calls 'search', but the line has no tools"),
    ("arguments not JSON", _line([USER, {"role": "assistant", "content": None,
                                         "tool_calls": [call("a", "search", "{query: x}")]}]),
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ("tool result answers no call", _line([USER, {"role": "assistant", "content": None,
                                                  "tool_calls": [call("a", "search", "{}")]},
                                           {"role": "tool", "tool_call_id": "b", "content": "r"},
                                           {"role": "assistant", "content": "x"}]),
     "messages[2] (tool) answers tool_call_id 'b', which no earlier assistant tool call has"),
    ("tool result before its call", _line([USER, {"role": "tool", "tool_call_id": "a", "content": "r"},
                                           {"role": "assistant", "content": None,
                                            "tool_calls": [call("a", "search", "{}")]}]),
     "messages[1] (tool) answers tool_call_id 'a', which no earlier assistant tool call has"),
    ("malformed tools", _line([USER, {"role": "assistant", "content": "x"}], tools=[{"type": "function"}]),
     "tools[0] must be {'type': 'function', 'function': {'name': ..., ...}}"),
    ("no assistant turn", _line([USER], tools=None), "no assistant turn to train on"),
    ("metadata not an object", json.dumps({**ARITHMETIC[0], "metadata": [1]}), "'metadata' must be an object"),
]


@pytest.mark.parametrize("line, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_line_is_named(line, text):
    with pytest.raises(DemonstrationError) as info:
        parse_jsonl(f"{GOOD}\n{line}\n{GOOD}\n", "demos.jsonl", BadLines("error"))
    assert str(info.value).startswith("demos.jsonl line 2: "), info.value
    assert text in str(info.value), info.value


def test_skip_counts_every_bad_line_and_keeps_the_good_ones():
    lines = [GOOD, json.dumps(TOOL_CONVERSATION)] + [c[1] for c in CASES] + ["", GOOD]
    bad = BadLines("skip")
    demos = parse_jsonl("\n".join(lines), "demos.jsonl", bad)
    assert [d.where for d in demos] == ["demos.jsonl line 1", "demos.jsonl line 2", f"demos.jsonl line {len(lines)}"]
    assert len(bad.skipped) == len(CASES)
    assert [s.split(":", 1)[0] for s in bad.skipped] == [f"demos.jsonl line {n}" for n in range(3, 3 + len(CASES))]
    assert demos[1].metadata == TOOL_CONVERSATION["metadata"] and demos[1].tools == TOOLS


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank lines"])
def test_an_empty_file_is_an_error_even_when_skipping(text):
    with pytest.raises(DemonstrationError, match="demos.jsonl: empty"):
        parse_jsonl(text, "demos.jsonl", BadLines("skip"))


def test_script_items_are_named_by_position():
    from agents.trajectory import Trajectory

    traj = Trajectory(messages_and_choices=TOOL_CONVERSATION["messages"], tools=TOOLS)
    with pytest.raises(DemonstrationError, match=r"conversation 1: messages\[0\].role must be one of"):
        demonstrations_of([traj, {"messages": [{"role": "robot", "content": "x"}]}], BadLines())
    assert demonstrations_of([traj], BadLines())[0].messages == TOOL_CONVERSATION["messages"]
