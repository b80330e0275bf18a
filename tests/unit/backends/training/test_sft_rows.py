"""SFT rows on exact tokens: a multi-turn tool conversation trains exactly its assistant turns (content, tool-call
text, end-of-turn token), and each turn starts where the server's prompt for it ends."""

from __future__ import annotations

import copy

import pytest

from backends.modeling.chat_render import end_of_turn_ids
from backends.serving.chat import ChatRequest, render_prompt
from backends.training.sft_data import BadLines, DemonstrationError, demonstration, parse_jsonl
from backends.training.sft_rows import demonstration_row, demonstration_rows
from tests.fixtures_sft import TOOL_CONVERSATION, TOOL_CONVERSATION_TURNS


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained positions."""
    spans, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_trained_tokens_are_exactly_the_assistant_turns(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    row = demonstration_row(tok, demonstration(TOOL_CONVERSATION, "demos.jsonl line 1"), {eos}, 4096)
    spans = _spans(row.loss_mask)
    assert len(spans) == len(TOOL_CONVERSATION_TURNS) == 3
    messages, tools = TOOL_CONVERSATION["messages"], TOOL_CONVERSATION["tools"]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for (start, end), text, i in zip(spans, TOOL_CONVERSATION_TURNS, assistant_at):
        # what the model is taught: the turn's text and the end-of-turn token, nothing of the template around it
        assert tok.decode(row.token_ids[start:end]) == text + "<|im_end|>"
        assert row.token_ids[end - 1] == eos
        # the server's prompt for this turn (backends/serving/chat.py) is the row up to the turn, token for token,
        # and the turn is the completion the model would sample: the text's tokens, then the end of turn
        prompt = render_prompt(tok, ChatRequest(model="m", messages=messages[:i], tools=tools))
        assert row.token_ids[:len(prompt)] == prompt and start == len(prompt)
        assert row.token_ids[start:end] == tok(text, add_special_tokens=False)["input_ids"] + [eos]
    # nothing else is trained: the system block with the tools, the user turn, the tool results, the template
    untrained = tok.decode([t for t, m in zip(row.token_ids, row.loss_mask) if not m])
    for part in ("Answer with the tools.", "# Tools", "Where is the Eiffel tower?", "<tool_response>",
                 "doc 3: The Eiffel tower", "It stands in Paris.", "Unrelated.", "<|im_start|>assistant\n"):
        assert part in untrained
    assert tok.decode(row.token_ids[spans[-1][1]:]) == "\n"  # after the last end of turn: template, untrained
    assert row.sampler_logprobs == [0.0] * len(row) and row.source == "demos.jsonl line 1"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_line(tok):
    # a template that drops earlier assistant turns' text (as reasoning templates drop old thinking)
    rewriting = copy.deepcopy(tok)
    rewriting.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] or '' }}{% endif %}"
        "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    demo = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "two"}]}
    with pytest.raises(DemonstrationError, match=r"demos.jsonl line 7: the chat template does not render "
                                                 r"messages\[1\] \(assistant\) as an extension"):
        demonstration_row(rewriting, demonstration(demo, "demos.jsonl line 7"), set(), 4096)


def test_too_long_is_a_bad_line_or_a_counted_skip(tok, tiny_hf):
    model = tiny_hf[0]
    text = "\n".join(['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                      '{"messages": [{"role": "user", "content": "' + "long " * 300 + '"}, '
                      '{"role": "assistant", "content": "ok"}]}'])
    demos = parse_jsonl(text, "d.jsonl", BadLines())
    ends = end_of_turn_ids(model, tok)
    with pytest.raises(DemonstrationError, match=r"d.jsonl line 2: \d+ tokens, longer than the context \(200 tokens"):
        demonstration_rows(tok, demos, ends, 200, BadLines("error"))
    bad = BadLines("skip")
    rows = demonstration_rows(tok, demos, ends, 200, bad)
    assert [r.source for r in rows] == ["d.jsonl line 1"] and len(bad.skipped) == 1
