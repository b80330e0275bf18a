"""The chunks of a streamed answer (``stream: true``), chat and text completions, in vLLM's dialect, built as the
engine's steps hand over tokens (`backends.inference.engine.Engine.stream`).

Per choice, in order:

- chat only: a first chunk ``delta: {"role": "assistant", "content": ""}``, carrying ``prompt_token_ids``;
- per batch of accepted tokens (one engine step's, or several when the server reads slower than the engine steps): a
  chunk with the text those tokens release (`stream_text`: held back while a UTF-8 character or a possible stop
  string is incomplete), their ``token_ids`` and, when asked, their ``logprobs`` (the format of the non-streamed
  answer, over this chunk's tokens; completions' ``text_offset`` counts from the choice's start). Text completions
  put ``prompt_token_ids`` on a choice's first such chunk, as vLLM does with ``return_token_ids``;
- a last chunk with the text still held (up to the engine's cut at a stop string), ``finish_reason`` and
  ``stop_reason``;

then, with ``stream_options.include_usage``, a chunk with no choices and the ``usage``, then ``data: [DONE]``. The
deltas of a choice concatenate to the non-streamed answer's text for the same seed.

Simplification (a difference from vLLM): with tools parsed (``tools`` given, ``tool_choice`` not ``"none"``), vLLM's
Hermes parser streams a call as it is decoded (name, then argument fragments). Here text is held back from where
``<tool_call>`` may begin, and the calls are parsed from the final text and sent whole in the last chunk (``delta:
{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}``, ``finish_reason: "tool_calls"``).
The content streamed before a call is the text before ``<tool_call>`` as the model wrote it, where the
non-streamed ``content`` has it stripped of surrounding whitespace.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from backends.inference.engine import Accepted, Completion
from backends.serving import chat, completions
from backends.serving.response_bytes import sse_events
from backends.serving.stream_text import StreamText
from backends.serving.token_text import TokenText
from backends.serving.tool_calls import OPEN, parse_tool_calls


class ChunkStream:
    """The chunks of one streamed answer over `prompts` (n choices each: choice j of prompt i is index i * n + j)."""

    object_name = ""
    id_prefix = ""

    def __init__(self, req, prompts: list[list[int]], names: TokenText, held: list[str]):
        self.req, self.prompts, self.names = req, prompts, names
        self.base = {"id": f"{self.id_prefix}-{secrets.token_hex(12)}", "object": self.object_name,
                     "created": int(time.time()), "model": req.model}
        self.texts = [StreamText(held) for _ in range(len(prompts) * req.n)]
        self.generated = 0

    def chunk(self, choice: dict) -> dict:
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[dict]:
        return []

    def encode(self, tokenizer, batch: list[tuple[int, list[Accepted] | list[Completion]]]) -> bytes:
        """`batch` (prompt index, a step's tokens or the prompt's completions) as server-sent events."""
        chunks = []
        for p, item in batch:
            if item and isinstance(item[0], Completion):
                for j, c in enumerate(item):
                    self.generated += len(c.token_ids)
                    chunks.append(self.chunk(self.last(p * self.req.n + j, c)))
                continue
            by_choice: dict[int, list[Accepted]] = {}
            for a in item:
                by_choice.setdefault(a.choice, []).append(a)
            for j, accepted in by_choice.items():
                index = p * self.req.n + j
                ids = [a.token for a in accepted]
                text = self.texts[index].push(tokenizer, ids)
                chunks.append(self.chunk(self.delta(index, text, ids, [a.logprob for a in accepted],
                                                    [a.top for a in accepted] if accepted[0].top else None)))
        return sse_events(chunks)

    def end(self) -> bytes:
        """The usage chunk if asked, and ``[DONE]``."""
        chunks = []
        if (self.req.stream_options or {}).get("include_usage"):
            prompt_tokens = self.prompt_tokens()
            chunks.append({**self.base, "choices": [],
                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": self.generated,
                                     "total_tokens": prompt_tokens + self.generated}})
        return sse_events(chunks, done=True)

    def prompt_tokens(self) -> int:
        """The usage's prompt tokens, counted as the non-streamed answer counts them: each prompt once per choice."""
        return sum(len(p) for p in self.prompts) * self.req.n

    def delta(self, index: int, text: str, ids: list[int], logprobs: list[float], tops: list | None) -> dict:
        raise NotImplementedError

    def last(self, index: int, c: Completion) -> dict:
        raise NotImplementedError


class ChatChunks(ChunkStream):
    """chat.completion.chunk objects."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, req: chat.ChatRequest, prompt: list[int], names: TokenText):
        self.tools = chat.tools_parsed(req)
        stops = req.sampling(None, 0).stop
        super().__init__(req, [prompt], names, stops + ([OPEN] if self.tools else []))

    def prompt_tokens(self) -> int:
        return len(self.prompts[0])  # the n choices share their prompt, as in the non-streamed usage

    def opening(self) -> list[dict]:
        return [{**self.chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}), "prompt_token_ids": self.prompts[0]}
                for i in range(self.req.n)]

    def delta(self, index: int, text: str, ids: list[int], logprobs: list[float], tops: list | None) -> dict:
        lps = None
        if self.req.logprobs:
            lps = chat.logprobs_json(ids, logprobs, tops, self.names, bool(self.req.return_tokens_as_token_ids))
        return {"index": index, "delta": {"content": text}, "logprobs": lps, "finish_reason": None, "token_ids": ids}

    def last(self, index: int, c: Completion) -> dict:
        calls: list[dict] = []
        if self.tools:
            _, calls = parse_tool_calls(c.text)
        final = c.text[: c.text.index(OPEN)] if calls else c.text
        rest = self.texts[index].finish(final)
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return {"index": index, "delta": delta, "logprobs": None,
                "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason}


class CompletionChunks(ChunkStream):
    """Streamed text_completion objects."""

    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, req: completions.CompletionRequest, prompts: list[list[int]], names: TokenText):
        super().__init__(req, prompts, names, req.sampling(None, 0).stop)
        self.offsets = [0] * len(self.texts)  # characters of token text before the next chunk's first token

    def delta(self, index: int, text: str, ids: list[int], logprobs: list[float], tops: list | None) -> dict:
        lps = None
        if self.req.logprobs is not None:
            lps = completions.logprobs_json(ids, logprobs, tops, self.names, self.req.logprobs,
                                            bool(self.req.return_tokens_as_token_ids), self.offsets[index])
        first = len(self.texts[index].ids) == len(ids)  # pushed already: these are its first tokens
        self.offsets[index] += sum(len(self.names.text(t)) for t in ids)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": None, "token_ids": ids}
        if first:
            choice["prompt_token_ids"] = self.prompts[index // self.req.n]
        return choice

    def last(self, index: int, c: Completion) -> dict:
        return {"index": index, "text": self.texts[index].finish(c.text), "logprobs": None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
