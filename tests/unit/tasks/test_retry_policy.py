"""Which failures the Prefect tasks retry: transient ones only."""

import asyncio

import httpx
import openai
import pytest

from tasks.support.retry_policy import PreemptedError, is_transient


def _status_error(cls, status: int):
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return cls("boom", response=httpx.Response(status, request=request), body=None)


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError("refused"),
    TimeoutError(),
    asyncio.TimeoutError(),
    PreemptedError("spot reclaim"),
    openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1")),
    _status_error(openai.InternalServerError, 503),
    _status_error(openai.RateLimitError, 429),
    httpx.ConnectError("no route"),
])
def test_transient_errors_are_retried(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    ValueError("bad config"),
    KeyError("missing"),
    _status_error(openai.BadRequestError, 400),
    _status_error(openai.NotFoundError, 404),
    _status_error(openai.AuthenticationError, 401),
])
def test_config_and_data_errors_are_not(exc):
    assert not is_transient(exc)


def test_causes_are_followed():
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)
