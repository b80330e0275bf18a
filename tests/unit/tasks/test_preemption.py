"""tasks/support/preemption.py with real signals sent to this process (pytest runs tests in the main thread)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from prefect.exceptions import TerminationSignal

from tasks.support.preemption import graceful_sigterm, preemption_requested, stop_if_requested


def test_preempt_first_sigterm_is_recorded_and_stops_at_the_next_safe_point(caplog):
    previous = signal.getsignal(signal.SIGTERM)
    with graceful_sigterm():
        stop_if_requested(3, "rollouts")  # nothing requested: a no-op
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption_requested()
        with caplog.at_level(logging.WARNING, logger="trajflow"), pytest.raises(TerminationSignal) as info:
            stop_if_requested(3, "rollouts")
    assert info.value.signal == signal.SIGTERM
    assert "preempted at step 3" in caplog.text and "before rollouts" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is previous and not preemption_requested()


def test_preempt_second_sigterm_goes_to_the_previous_handler():
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with graceful_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [] and preemption_requested()
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
