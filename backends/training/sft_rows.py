"""Supervised rows: a demonstration rendered with the chat template into one exact-token training row.

The row is the whole conversation as the chat template renders it (``render_chat``, the server's own rendering,
tools and ``TOOL_CHAT_TEMPLATE`` included). Trained (mask 1): each assistant turn's tokens, i.e. what the model
would have sampled after the server's prompt for that turn: its content, its tool-call text
(``<tool_call>{...}</tool_call>`` on ChatML) and the end-of-turn token that ends it. Everything else (system, user and
tool messages, the template between turns, the generation prompt ``<|im_start|>assistant\\n``, any text the template
adds after the end-of-turn token) is context (mask 0).

Boundaries come from rendering prefixes, never from searching the text: for the assistant message i,
``P_i = render(messages[:i], generation prompt)`` is the prompt a rollout would send, and
``T_i = render(messages[:i+1])`` the conversation through that turn; both must be token prefixes of the full render
``F``, and the turn's tokens are ``F[len(P_i):len(T_i)]``, trained up to and including their last end-of-turn id
(all of them when it has none). A template that rewrites earlier turns (drops old reasoning, re-tokenises) breaks the
prefix property; that conversation is refused, naming its line, rather than trained on tokens the model never saw.

A row longer than ``max_tokens`` (the smaller of the configured ``max_length`` and the model's context) is refused
too: truncating a demonstration would teach a turn without its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.modeling.chat_render import ChatRenderError, render_chat
from backends.training.sft_data import BadLines, Demonstration, DemonstrationError
from backends.training.token_rows import TrainingRow


def _prefix_of(part: list[int], full: list[int]) -> bool:
    return len(part) <= len(full) and full[: len(part)] == part


def demonstration_row(tokenizer, demo: Demonstration, end_ids: set[int], max_tokens: int) -> TrainingRow:
    """The training row of one demonstration; DemonstrationError naming `demo.where` when it cannot be built."""
    messages, tools = demo.messages, demo.tools
    try:
        full = render_chat(tokenizer, messages, tools, add_generation_prompt=False)
        mask = [False] * len(full)
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prompt = render_chat(tokenizer, messages[:i], tools, add_generation_prompt=True)
            through = render_chat(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
            if not (_prefix_of(prompt, full) and _prefix_of(through, full) and len(through) > len(prompt)):
                raise DemonstrationError(
                    f"{demo.where}: the chat template does not render messages[{i}] (assistant) as an extension of "
                    "the conversation before it (it rewrites earlier turns), so its tokens cannot be found exactly")
            turn = range(len(prompt), len(through))
            ends = [t for t in turn if full[t] in end_ids]
            for t in range(turn.start, (ends[-1] + 1) if ends else turn.stop):
                mask[t] = True
    except ChatRenderError as e:
        raise DemonstrationError(f"{demo.where}: {e}") from None
    if not any(mask):
        raise DemonstrationError(f"{demo.where}: its assistant turns render to no tokens")
    if len(full) > max_tokens:
        raise DemonstrationError(f"{demo.where}: {len(full)} tokens, longer than the context ({max_tokens} tokens: "
                                 "the smaller of sft max_length and the model's max positions)")
    return TrainingRow(list(full), mask, [0.0] * len(full), source=demo.where)


def demonstration_rows(tokenizer, demos: Sequence[Demonstration], end_ids: set[int], max_tokens: int,
                       bad: BadLines) -> list[TrainingRow]:
    """One row per usable demonstration; a bad one raises or is counted in `bad`."""
    rows = []
    for demo in demos:
        try:
            rows.append(demonstration_row(tokenizer, demo, end_ids, max_tokens))
        except DemonstrationError as e:
            bad.handle(e)
    return rows
