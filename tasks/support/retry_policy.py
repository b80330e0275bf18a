"""Which failures a task retries: transient ones only (connection loss, timeouts, 5xx, preemption).

Config errors, bad data and bugs fail at once: retrying them only hides the message for longer.

The rule, for a live exception (``is_transient``, which also looks through up to 8 causes):

    transient = an instance of TransientError, ConnectionError or TimeoutError
             or an OSError whose errno is a network one (refused, reset, timed out, broken pipe, unreachable)
             or it carries an HTTP status, and the status is in TRANSIENT_HTTP
             or it carries none, and its type's name is in TRANSIENT_TYPE_NAMES

and for a recorded one, of which only the type's name is kept (a rollout's failure in its group):
the name is in ``TRANSIENT_TYPE_NAMES`` (``is_transient_type_name``). Types are listed by name so
that this module imports no client library, and so that both kinds are judged by the same list. The
status outranks the name because openai's ``InternalServerError`` is any 5xx, and a 501 is not
worth retrying.
"""

from __future__ import annotations

import asyncio
import errno

TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}

TRANSIENT_TYPE_NAMES = frozenset({
    "APIConnectionError", "APITimeoutError", "InternalServerError",  # openai (InternalServerError: a 5xx)
    "ConnectError", "ConnectTimeout", "ReadTimeout", "ReadError", "RemoteProtocolError",  # httpx
    "EndpointConnectionError",  # botocore, under s3fs
    "ConnectionError",  # the builtin, and requests' of the same name
})


class TransientError(RuntimeError):
    """Raised by our own code for a condition worth retrying (e.g. server not ready yet)."""


class PreemptedError(TransientError):
    """The machine is being taken away (SIGTERM from a spot reclaim); the step resumes elsewhere."""


def is_transient_type_name(name: str) -> bool:
    """True when an exception type of this name is transient (see ``TRANSIENT_TYPE_NAMES``)."""
    return name in TRANSIENT_TYPE_NAMES


def is_transient(exc: BaseException | None) -> bool:
    """True for network, timeout, 5xx/429 and preemption errors, looking through causes."""
    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        if isinstance(exc, TransientError | ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT,
                                                      errno.EPIPE, errno.EHOSTUNREACH):
            return True
        status = getattr(exc, "status_code", None) or getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int):
            if status in TRANSIENT_HTTP:
                return True
        elif is_transient_type_name(type(exc).__name__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_condition(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only transient failures."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we classify whatever the task raised
        return is_transient(exc)
    return False
