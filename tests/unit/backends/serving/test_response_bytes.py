"""Bodies as bytes: responses encoded on a worker (orjson, else the stdlib: the same JSON), requests parsed with
the stdlib's meaning, token texts as the tokenizer decodes them."""

from __future__ import annotations

import json
import math

import pytest

from backends.serving import response_bytes
from backends.serving.request_bodies import BadBody, parse_json
from backends.serving.response_bytes import check_finite, json_bytes, sse_events
from backends.serving.token_text import TokenText

RESPONSE = {"id": "cmpl-1", "text": "héllo \u2028 \"q\" \\ \n", "logprobs": {"token_logprobs": [-0.1, -1e-05, -12.5],
            "top_logprobs": [{"token_id:5": -0.1}], "tokens": ["a", "é"]}, "token_ids": [1, 2**62], "ok": True,
            "stop_reason": None, "usage": {"prompt_tokens": 3}}


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_json_bytes_is_the_json_starlette_wrote(fast, monkeypatch):
    if not fast:
        monkeypatch.setattr(response_bytes, "orjson", None)
    out = json_bytes(RESPONSE)
    assert json.loads(out) == RESPONSE
    assert "héllo".encode() in out and b": " not in out  # UTF-8 unescaped, compact, as Starlette's JSONResponse


def test_integers_beyond_64_bits_are_encoded_by_the_stdlib():
    assert json.loads(json_bytes({"seed": 2**70})) == {"seed": 2**70}


def test_sse_events_frames_each_chunk_and_ends_with_done():
    body = sse_events([{"a": 1}, {"b": [2]}], done=True).decode()
    assert body == 'data: {"a":1}\n\ndata: {"b":[2]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("values", [[-0.5, math.nan], [-math.inf], [math.inf, -math.inf], [1e308, 1e308]])
def test_a_non_finite_logprob_is_refused(values):
    with pytest.raises(ValueError, match="non-finite logprob"):
        check_finite(values, "logprob")
    check_finite([-0.5, -1e30, 0.0], "logprob")


@pytest.mark.parametrize("raw, value", [
    (b'{"seed": 123456789012345678901234567890}', {"seed": 123456789012345678901234567890}),  # stays an int
    (b'{"temperature": NaN}', "nan"),  # the stdlib's reading: validation then names the field
    (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a UTF-8 byte order mark, as json.loads reads bytes
    (b'{"a": [1, 2.5, "x", {"b": null}]}', {"a": [1, 2.5, "x", {"b": None}]}),
])
def test_request_bodies_mean_what_the_stdlib_reads(raw, value):
    parsed = parse_json(raw)
    if value == "nan":
        assert math.isnan(parsed["temperature"])
    else:
        assert parsed == value and parsed == json.loads(raw)


@pytest.mark.parametrize("raw, message", [
    (b'{"messages": [{"content": "a\\ud800b"}]}', "lone UTF-16 surrogate"),
    (b"[" * 65 + b"]" * 65, "nests deeper than 64 levels"),
    (b'{"a": ' * 65 + b"1" + b"}" * 65, "nests deeper than 64 levels"),
    (b"{oops", "not valid JSON"),
])
def test_bad_bodies_are_named(raw, message):
    with pytest.raises(BadBody, match=message):
        parse_json(raw)


def test_token_texts_are_the_tokenizers_own(tiny_hf):
    tok = tiny_hf[1]
    names = TokenText(tok, len(tok) + 3)  # ids past the tokenizer (a model vocabulary can be larger) decode to ""
    names.warm()
    for token in range(len(tok) + 3):
        assert names.text(token) == tok.decode([token])
        assert names.entry(token, False) == (tok.decode([token]), list(tok.decode([token]).encode()))
    assert names.entry(7, True) == ("token_id:7", list(b"token_id:7"))
