"""Which failures a task retries: transient ones only (connection loss, timeouts, 5xx, preemption).

Config errors, bad data and bugs fail at once: retrying them only hides the message for longer.
"""

from __future__ import annotations

import asyncio
import errno

TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}


class TransientError(RuntimeError):
    """Raised by our own code for a condition worth retrying (e.g. server not ready yet)."""


class PreemptedError(TransientError):
    """The machine is being taken away (SIGTERM from a spot reclaim); the step resumes elsewhere."""


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
        name = type(exc).__name__
        if name in ("APIConnectionError", "APITimeoutError", "ConnectError", "ReadTimeout", "ConnectTimeout",
                    "RemoteProtocolError", "ReadError", "EndpointConnectionError"):
            return True
        status = getattr(exc, "status_code", None) or getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int) and status in TRANSIENT_HTTP:
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
