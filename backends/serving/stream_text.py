"""The text of one streamed choice, released as its tokens arrive; what has been sent is always a prefix of the text
the non-streamed answer carries.

Incremental detokenization, as vLLM does it: a step's new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``
over a window of the last few tokens, not the whole sequence, so a step costs the same at token 10 and token 4,000;
taking the difference of two decodes keeps what a tokenizer does at the start of a text (SentencePiece drops a
leading space) out of the delta. Text is held back:

1. while the window's text ends in U+FFFD: a token that ends inside a UTF-8 character decodes to the replacement
   character until a later token completes it;
2. from the first occurrence of a held string (the request's stop strings; ``<tool_call>`` when tool calls are
   parsed), and from a suffix that may be the start of one: the engine cuts its answer before a stop string, so a
   stop string split across tokens is never sent, and a tool call is sent whole at the end.

`finish(final_text)` releases the rest: the engine's own text of the choice (already cut at a stop string).
"""

from __future__ import annotations

import logging

from backends.serving.token_text import text_decoder

log = logging.getLogger(__name__)
REPLACEMENT = "\ufffd"


class StreamText:
    """The incremental text of one choice; `held` are the strings text is held back at (module docstring)."""

    def __init__(self, held: list[str]):
        self.held = [h for h in held if h]
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window: ids[prefix:read] is decoded text already taken
        self.text = ""  # the text of ids[:read]
        self.sent = 0  # characters of `text` released

    def push(self, tokenizer, ids: list[int]) -> str:
        """Take `ids` (the choice's next tokens); the text they release (maybe empty)."""
        self.ids.extend(ids)
        decode = text_decoder(tokenizer)
        before = decode(self.ids[self.prefix:self.read])
        window = decode(self.ids[self.prefix:])
        if len(window) > len(before) and not window.endswith(REPLACEMENT):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        text, end = self.text, len(self.text)
        for held in self.held:
            at = text.find(held, self.sent)
            if at >= 0:
                end = min(end, at)
                continue
            for k in range(min(len(held) - 1, end - self.sent), 0, -1):  # a suffix that may begin `held`
                if text.endswith(held[:k]):
                    end = min(end, len(text) - k)
                    break
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (what the non-streamed answer says) after what was released."""
        if not final_text.startswith(self.released):  # a tokenizer whose decode is not prefix-stable (space clean-up)
            log.warning("streamed text %r is not a prefix of the final text %r", self.released[-40:], final_text[-40:])
        return final_text[self.sent:]

    @property
    def released(self) -> str:
        return self.text[: self.sent]
