"""OpenAI text completions (``POST /v1/completions``) <-> engine requests, in vLLM's dialect.

What it is for: continuing exact token ids. ``prompt`` is a list of token ids (sent to the engine as they are, no
template, no special tokens added), a string (tokenized with ``add_special_tokens``, default true as in vLLM), or a
list of either (one request per prompt; ``choices[i * n + j]`` is choice j of prompt i, as in vLLM).

- Accepted: ``model, prompt, n, max_tokens`` (default 16), ``temperature, top_p, seed, stop, logprobs`` (k: the
  sampled token's logprob plus the top k alternatives), ``stream, stream_options, user`` and vLLM's extras
  ``stop_token_ids, ignore_eos, return_token_ids, return_tokens_as_token_ids, add_special_tokens, logprobs_mode``.
  Refused with a 400 rather than silently dropped: ``echo``, ``suffix``, ``best_of`` above n, prompt logprobs, and
  the sampling features chat refuses (`backends.serving.chat.SamplingFields.unsupported`).
- Each choice carries ``text``, ``logprobs`` in the completions format (``tokens, token_logprobs, top_logprobs,
  text_offset``; raw logprobs, temperature 1), ``finish_reason``, ``stop_reason``, and always ``token_ids`` and
  ``prompt_token_ids`` (vLLM's ``return_token_ids`` fields).
- ``top_logprobs[j]`` maps token text (or ``token_id:<id>`` with ``return_tokens_as_token_ids``) to logprob: the
  sampled token first, then the top k, as vLLM builds it (k + 1 entries when the sampled token is not in the top k).
"""

from __future__ import annotations

import secrets
import time
from itertools import accumulate
from typing import Any

from pydantic import Field

from backends.inference.engine import MAX_TOP_LOGPROBS, Completion, RequestError, SamplingParams
from backends.serving.chat import SamplingFields, validate_body
from backends.serving.response_bytes import check_finite
from backends.serving.token_text import TokenText


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions."""

    prompt: Any = Field(description="token ids, a string, or a list of either")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    def unsupported(self) -> list[str]:
        return super().unsupported() + [
            name for name, ok in (
                ("echo", not self.echo), ("suffix", not self.suffix),
                ("best_of", self.best_of in (None, self.n)), ("prompt_logprobs", self.prompt_logprobs is None),
            ) if not ok
        ]

    def sampling_params(self) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs or 0)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a completions body; raises RequestError with every problem named."""
    return validate_body(CompletionRequest, body)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompts(tokenizer, req: CompletionRequest, vocab: int) -> list[list[int]]:
    """The request's prompts as token id lists; RequestError naming the prompt (and position) that is wrong."""
    raw = req.prompt
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestError("prompt must be a non-empty string, a non-empty list of token ids, or a list of those")
    prompts = []
    for i, item in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = list(tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]) if item else []
        elif _is_ids(item):
            ids = list(item)
        else:
            raise RequestError(f"{where} must be a string or a list of integer token ids")
        if not ids:
            raise RequestError(f"{where} is empty")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"{where}: token id {ids[bad]} at position {bad} is outside the vocabulary "
                               f"[0, {vocab})")
        prompts.append(ids)
    return prompts


def logprobs_json(token_ids: list[int], logprobs: list[float], top_logprobs: list | None, names: TokenText, k: int,
                  as_ids: bool, offset: int = 0) -> dict:
    """``logprobs`` of a choice, or of a streamed chunk's tokens whose text starts at character `offset`."""
    check_finite(logprobs, "logprob")
    texts = [names.text(tok) for tok in token_ids]
    tokens = [f"token_id:{tok}" for tok in token_ids] if as_ids else texts
    offsets = list(accumulate(map(len, texts), initial=offset))[:-1]
    if top_logprobs is None or k == 0:
        tops = [{label: lp} for label, lp in zip(tokens, logprobs)]
    else:
        tops = []
        for label, lp, alts in zip(tokens, logprobs, top_logprobs):
            check_finite([v for _, v in alts[:k]], "top logprob")
            top = {label: lp}
            for alt, value in alts[:k]:
                top.setdefault(names.label(alt, as_ids), value)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def choice_json(index: int, c: Completion, req: CompletionRequest, prompt: list[int], names: TokenText) -> dict:
    """One `choices[i]` of the response."""
    logprobs = None
    if req.logprobs is not None:
        logprobs = logprobs_json(c.token_ids, c.logprobs, c.top_logprobs, names, req.logprobs,
                                 bool(req.return_tokens_as_token_ids))
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "token_ids": c.token_ids, "prompt_token_ids": prompt,
            "prompt_logprobs": None}


def response_json(req: CompletionRequest, prompts: list[list[int]], results: list[list[Completion]],
                  names: TokenText) -> dict:
    """The text_completion object: choices prompt-major (choice j of prompt i at index i * n + j)."""
    choices = [choice_json(i * req.n + j, c, req, prompt, names)
               for i, (prompt, completions) in enumerate(zip(prompts, results)) for j, c in enumerate(completions)]
    prompt_tokens = sum(len(p) * req.n for p in prompts)
    generated = sum(len(c.token_ids) for cs in results for c in cs)
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated},
    }
