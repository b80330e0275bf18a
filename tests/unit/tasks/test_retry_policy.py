"""Which failures the Prefect tasks retry: transient ones only."""

import asyncio

import httpx
import openai
import pytest

from agents.trajectory import RecordedException
from tasks.support.retry_policy import TRANSIENT_TYPE_NAMES, PreemptedError, is_transient, is_transient_type_name


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


@pytest.mark.parametrize("exc", [
    openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1")),
    openai.APITimeoutError(request=httpx.Request("POST", "http://127.0.0.1")),
    httpx.ConnectError("no route"),
    httpx.ConnectTimeout("slow connect"),
    httpx.ReadTimeout("slow read"),
    httpx.ReadError("reset"),
    httpx.RemoteProtocolError("peer closed"),
    ConnectionError("lost"),
])
def test_a_recorded_failure_is_judged_by_the_same_rule(exc):
    """A rollout's failure keeps only its type's name; the name alone says transient, as the live exception does."""
    recorded = RecordedException.from_exception(exc)
    assert is_transient(exc)
    assert recorded.type in TRANSIENT_TYPE_NAMES and is_transient_type_name(recorded.type)


@pytest.mark.parametrize("name", ["ValueError", "KeyError", "RolloutTimeout", "BadRequestError", "TypeError"])
def test_other_names_are_not_transient(name):
    assert not is_transient_type_name(name)


def test_an_http_status_outranks_the_type_name():
    """openai's InternalServerError is any 5xx: a 503 is retried, a 501 is not; recorded, the name says transient."""
    assert is_transient(_status_error(openai.InternalServerError, 503))
    assert not is_transient(_status_error(openai.InternalServerError, 501))
    assert is_transient_type_name("InternalServerError")
