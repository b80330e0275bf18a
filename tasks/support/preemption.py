"""Graceful preemption: a SIGTERM (spot reclaim, Kubernetes eviction) stops the training flow at the next safe point.

Rule: while ``graceful_sigterm()`` is active, SIGTERM only records the request. Work stops at the next safe
point: before each stage of a step (the flow's StageTimer) and, inside the rollouts stage, at once, abandoning
the groups in flight (a group's file is written under a temporary name and renamed, so a write already started
finishes or never appears). There ``stop_if_requested(step)`` logs "preempted at step N" and raises Prefect's
``TerminationSignal``, which is what Prefect itself raises on a SIGTERM: the engine marks the run ``Crashed``
(not ``Failed``: a crash is what gets rerun) and the process then ends by SIGTERM. The flow's ``finally``
releases the run lease on the way out, so the next start takes over at once.

Choices: a second SIGTERM goes to the handler that was there before (Prefect's: stop now), for an operator who
will not wait; SIGKILL cannot be caught and keeps the crash guarantees of the store (nothing half-written, the
lease expires by itself). Outside the main thread signals cannot be handled, and the guard does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("trajflow")

_requested = threading.Event()


def preemption_requested() -> bool:
    """True once SIGTERM arrived while ``graceful_sigterm()`` was active."""
    return _requested.is_set()


def stop_if_requested(step: int, where: str) -> None:
    """At a safe point: if preemption was requested, log it and raise Prefect's TerminationSignal (run Crashed)."""
    if not _requested.is_set():
        return
    from prefect.exceptions import TerminationSignal

    log.warning("preempted at step %d (SIGTERM, stopping before %s); a rerun resumes from the last committed step",
                step, where)
    raise TerminationSignal(signal=signal.SIGTERM)


@contextlib.contextmanager
def graceful_sigterm() -> Iterator[None]:
    """Within: the first SIGTERM sets the request flag; the next goes to the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if _requested.is_set():
            signal.signal(signal.SIGTERM, previous)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _requested.set()
        log.warning("SIGTERM received: stopping at the next safe point")

    _requested.clear()
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _requested.clear()
